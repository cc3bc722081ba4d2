#!/usr/bin/env bash
# Issue 34 on 2 or 4 GPUs (one call each part; carry .whl):
#   PART=tests   the GPU tests of async TP and of every layout from the same weights
#   PART=layouts check_layouts' TP / PP / async / float8 layouts against one GPU, 20 steps
#   PART=estimator the estimator's TP / PP rows (predicted vs measured per rank, eager)
set -uo pipefail
source dev/gpu_calls/common.sh
N=$(nvidia-smi -L | wc -l)
case "${PART:?PART=tests|layouts|estimator}" in
tests)
  run async_tp 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/integration/test_async_tp_gpu.py
  run layouts_init 380 python3 -m pytest -m gpu -q -p no:cacheprovider tests/integration/test_gpu_layouts_init.py
  tail -n 3 "$OUT"/async_tp.log "$OUT"/layouts_init.log ;;
layouts)
  WORLDS="2"; [ "$N" -ge 4 ] && WORLDS="2 4"
  run check 580 bash scripts/check_layouts.sh --worlds "$WORLDS" --steps 20 \
    --only 'dense_ref|moe_ref|tp2|pp2|async|float8' "$OUT/layouts"
  tail -n 40 "$OUT/check.log" ;;
estimator)
  B="train_configs/qwen3_8b_fsdp.toml --model.n_layers 8 --training.local_batch_size 1 --compile.enable false"
  M="train_configs/qwen3_moe_1gpu.toml --training.local_batch_size 2 --compile.enable false"
  PP="--parallelism.pipeline_parallel_degree 2"  # the 8B flavor is untied, as PP needs
  run est 580 python3 scripts/validate_estimator.py --world_size "$N" --out "$OUT/estimator.md" --configs \
    "$B --parallelism.tensor_parallel_degree 2" \
    "$B --parallelism.tensor_parallel_degree 2 --activation_checkpoint.mode full" \
    "$M --parallelism.tensor_parallel_degree 2" \
    "$B $PP --parallelism.pipeline_parallel_schedule 1F1B" \
    "$B $PP --parallelism.pipeline_parallel_schedule GPipe" \
    "$B $PP --parallelism.pipeline_parallel_schedule Interleaved1F1B"
  cat "$OUT/estimator.md" ;;
esac
