#!/usr/bin/env bash
# The GPU-validation table of docs/memory_estimation.md: the CUDA estimate (compiled program
# where the config compiles) against active_bytes.all.peak of the second of two real steps.
set -euo pipefail
case "${1:-}" in
  -h | --help)
    cat <<'USAGE'
usage: scripts/validate_estimator_gpu.sh OUT_DIR [NGPU [INDICES]]

Qwen3 shapes with 4 blocks, seq 2048. Without NGPU (or NGPU=1): 11 one-GPU configs, measured
in this process, in this order (0.6B, compiled blocks and chunked loss unless said):
  1 as shipped   2 eager   3 plain loss   4 plain loss, eager   5 AC full   6 AC selective op
  7 padding   8 float8   9 LoRA   10 1.7B   11 the shipped 0.6B recipe as it is
With NGPU=N >= 2: 15 configs on N GPUs, in this order:
  1 EP N (MoE debug shapes of 30B-A3B), compiled   2 EP N, eager
  3 N >= 4: HSDP 2 x N/2                           4 N >= 4: CP 2 x FSDP N/2, compiled
    N = 2:  CP 2, eager                              N = 2:  0.6B compiled plain loss, FSDP 2
  5 1.7B FSDP N, compiled   6 eager   7 ZeRO-2 mode (reshard never)   8 AC full
  PP 2 on the 8B shapes cut to 8 blocks, batch 4 x 4096 (micro-batches of 1):
  9 1F1B, eager   10 GPipe, eager   11 Interleaved1F1B, eager   12 1F1B, compiled
  TP 2 (sequence parallel), eager: 13 1.7B, batch 2 x 4096   14 the same, AC full
  15 the 8B shapes cut to 8 blocks, batch 1 x 8192
Each multi-GPU config spawns N fresh processes (about 50 s each). INDICES (comma-separated,
1-based, e.g. 1,2,4) runs only those configs of the list, to fit a time slot.
Prints each row as soon as it is measured (predicted vs measured per rank) and rewrites
OUT_DIR/estimator_validation_wN.md after each row. PYTHON picks the interpreter (default
python3).
USAGE
    exit 0
    ;;
esac
OUT=${1:?usage: scripts/validate_estimator_gpu.sh OUT_DIR [NGPU [INDICES]]}
N=${2:-1}
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
S="--model.n_layers 4 --training.seq_len 2048 --training.local_batch_size 4"
Z="train_configs/qwen3_0.6b.toml $S"          # compiled (model + chunked loss) as shipped
Y="train_configs/qwen3_1.7b.toml $S"
E="--compile.enable false"
if [ "$N" -eq 1 ]; then
  CONFIGS=(
    "$Z"
    "$Z $E"
    "$Z --training.loss_chunk_size 0"
    "$Z --training.loss_chunk_size 0 $E"
    "$Z --activation_checkpoint.mode full"
    "$Z --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op"
    "$Z --training.packing padding"
    "$Z --float8.enable true"
    "$Z --lora.enable true"
    "$Y"
    "train_configs/qwen3_0.6b.toml"  # the shipped recipe whole: 28 blocks, batch 8 x 4096
  )
else
  M="train_configs/qwen3_moe_ep4.toml --model.n_layers 4 --training.seq_len 2048 --training.local_batch_size 2"
  CONFIGS=(
    "$M --parallelism.expert_parallel_degree $N --compile.enable true --activation_checkpoint.mode none"
    "$M --parallelism.expert_parallel_degree $N $E"
  )
  if [ "$N" -ge 4 ]; then
    CONFIGS+=(
      "$Y --parallelism.data_parallel_replicate_degree 2"
      "$Y --parallelism.context_parallel_degree 2"
    )
  else
    CONFIGS+=(
      "$Y --parallelism.context_parallel_degree 2 $E"
      "$Z --training.loss_chunk_size 0"
    )
  fi
  CONFIGS+=(
    "$Y"
    "$Y $E"
    "$Y --parallelism.fsdp_reshard_after_forward never"
    "$Y --activation_checkpoint.mode full"
  )
  # Pipeline and tensor parallel (2 ranks each, FSDP over the rest): the untied 8B shapes cut
  # to 8 blocks, and 1.7B.
  B8="train_configs/qwen3_8b_fsdp.toml --model.n_layers 8 --activation_checkpoint.mode none"
  PP="$B8 --training.local_batch_size 4 --training.seq_len 4096 --parallelism.pipeline_parallel_degree 2"
  T17="train_configs/qwen3_1.7b.toml --training.local_batch_size 2 --training.seq_len 4096 --parallelism.tensor_parallel_degree 2"
  SCHEDULE=--parallelism.pipeline_parallel_schedule
  CONFIGS+=(
    "$PP $E"
    "$PP $E $SCHEDULE GPipe"
    "$PP $E $SCHEDULE Interleaved1F1B"
    "$PP"
    "$T17 $E"
    "$T17 $E --activation_checkpoint.mode full"
    "$B8 --training.local_batch_size 1 --training.seq_len 8192 --parallelism.tensor_parallel_degree 2 $E"
  )
fi
if [ -n "${3:-}" ]; then
  SELECTED=()
  IFS=, read -ra INDICES <<<"$3"
  for i in "${INDICES[@]}"; do
    if ! [[ "$i" =~ ^[0-9]+$ ]] || [ "$i" -lt 1 ] || [ "$i" -gt "${#CONFIGS[@]}" ]; then
      echo "INDICES: '$i' is not a config number 1..${#CONFIGS[@]} (see --help)" >&2
      exit 2
    fi
    SELECTED+=("${CONFIGS[$((i - 1))]}")
  done
  CONFIGS=("${SELECTED[@]}")
fi
"$PYTHON" -u scripts/validate_estimator.py --world_size "$N" --out "$OUT" --configs "${CONFIGS[@]}"
