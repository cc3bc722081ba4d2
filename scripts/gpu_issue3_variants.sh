#!/usr/bin/env bash
# Qwen3-1.7B, 20 steps per variant on one GPU: bf16 eager, compile, AC full, AC selective op,
# float8 tensorwise. Usage on the device: bash scripts/gpu_issue3_variants.sh $OUT
set -u
out=${1:-outputs/issue3}
common=(--job.config_file train_configs/qwen3_1.7b.toml --training.steps 20 --metrics.log_freq 2
        --training.dataset text --training.dataset_path assets/data/debug_corpus.jsonl
        --training.local_batch_size 2 --lr_scheduler.warmup_steps 5)
run() { name=$1; shift; NGPU=1 timeout 150 ./run_train.sh "${common[@]}" --job.dump_folder "$out/$name" "$@" \
          > "$out/$name.log" 2>&1 || echo "$name failed: $(grep -m1 -E 'Error|error' "$out/$name.log")"; }
mkdir -p "$out"
run bf16_eager
run compile --compile.enable
run ac_full --activation_checkpoint.mode full
run ac_selective_op --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op
run float8 --float8.enable
run float8_compile --float8.enable --compile.enable
python3 scripts/summarize_runs.py "$out"/bf16_eager "$out"/compile "$out"/ac_full "$out"/ac_selective_op "$out"/float8 "$out"/float8_compile | tee "$out/table.md"
