#!/usr/bin/env bash
# bf16 vs float8 (tensorwise, rowwise) on Qwen3-1.7B, all compiled, 20 steps, one GPU.
# Usage on the device: bash scripts/gpu_float8_check.sh /tmp/f8
set -u
out=${1:-outputs/float8_check}
common=(--job.config_file train_configs/qwen3_1.7b.toml --training.steps 20 --metrics.log_freq 2
        --training.local_batch_size 2 --lr_scheduler.warmup_steps 5 --compile.enable)
run() { name=$1; shift; NGPU=1 timeout 150 ./run_train.sh "${common[@]}" --job.dump_folder "$out/$name" "$@" \
          > "$out/$name.log" 2>&1 || echo "$name failed: $(grep -m1 -E 'Error|error' "$out/$name.log")"; }
mkdir -p "$out"
run bf16_compile
run float8_tensorwise_compile --float8.enable
run float8_rowwise_compile --float8.enable --float8.recipe rowwise
python3 scripts/summarize_runs.py "$out"/bf16_compile "$out"/float8_tensorwise_compile "$out"/float8_rowwise_compile | tee "$out/table.md"
for f in "$out"/*/metrics.jsonl; do echo "$f"; python3 -c "import json,sys; print([round(json.loads(l)['loss'],3) for l in open(sys.argv[1])])" "$f"; done
