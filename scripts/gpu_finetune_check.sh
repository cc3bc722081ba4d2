#!/usr/bin/env bash
# Fine-tuning on one GPU (issue 7): full SFT of Qwen3-0.6B from an HF-format folder, and LoRA r16
# on Qwen3-1.7B. No hub on the device, so the HF folder is a random Qwen3-0.6B written by
# transformers; the point is the load path at full size plus tokens/s and memory.
#   source scripts/device_setup.sh; bash scripts/gpu_finetune_check.sh OUTDIR
set -u
out=$1
mkdir -p "$out"
python3 - "$out/hf06" <<'PY'
import sys, torch, transformers
from torchtitan_ablate.models.qwen3 import qwen3_flavors
cfg = transformers.Qwen3Config(**qwen3_flavors["0.6B"].to_hf_config())
torch.manual_seed(0)
transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])
print("wrote", sys.argv[1])
PY
sft=train_configs/qwen3_0.6b_sft.toml
common="--training.steps 30 --metrics.log_freq 5 --checkpoint.enable false"
timeout 200 ./run_train.sh --job.config_file $sft $common --checkpoint.initial_load_path "$out/hf06" \
  --model.flavor auto --job.dump_folder "$out/full_ft_0.6b" >"$out/full_ft_0.6b.log" 2>&1
echo "full FT exit $?"
timeout 200 ./run_train.sh --job.config_file $sft $common --model.flavor 1.7B --lora.enable true \
  --lora.rank 16 --optimizer.lr 2e-4 --job.dump_folder "$out/lora_1.7b" >"$out/lora_1.7b.log" 2>&1
echo "LoRA exit $?"
for run in full_ft_0.6b lora_1.7b; do
  echo "== $run"; grep -E "parameters|loaded|initial" "$out/$run.log" | head -3
  python3 scripts/summarize_runs.py "$out/$run" 2>/dev/null || tail -3 "$out/$run/metrics.jsonl"
done
