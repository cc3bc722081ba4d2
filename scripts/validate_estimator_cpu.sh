#!/usr/bin/env bash
# The CPU-validation table of docs/memory_estimation.md: fake estimate vs real gloo ranks for the
# debug models in 10 layouts (2 ranks, seq 128, local batch 2). Prints the table; exit 1 if any
# row is off by more than 5%.
set -euo pipefail
case "${1:-}" in
  -h | --help)
    cat <<'USAGE'
usage: scripts/validate_estimator_cpu.sh

Checks the memory estimator against real training on CPU: for the debug models in 10 layouts
(FSDP 2, ZeRO-2 mode, AC full, AC selective op, CP 2, TP 2, MoE EP 2, replicate 2, float8, gradient
accumulation; 2 gloo ranks, seq 128, local batch 2) it prints the predicted and the measured
peak memory (scripts/validate_estimator.py). Exit 1 if any row is off by more than 5%.
About 2 minutes on 2 cores. PYTHON picks the interpreter (default .venv/bin/python).
USAGE
    exit 0
    ;;
esac
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
B="--training.seq_len 128 --training.local_batch_size 2"
D="train_configs/debug_model.toml $B"
"$PYTHON" scripts/validate_estimator.py --world_size 2 --configs \
  "$D" \
  "$D --parallelism.fsdp_reshard_after_forward never" \
  "$D --activation_checkpoint.mode full" \
  "$D --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op" \
  "$D --parallelism.context_parallel_degree 2" \
  "$D --parallelism.tensor_parallel_degree 2" \
  "train_configs/qwen3_moe_debug.toml $B --parallelism.expert_parallel_degree 2" \
  "$D --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1" \
  "$D --float8.enable true" \
  "$D --training.global_batch_size 8"
