#!/usr/bin/env bash
# Every parallel layout against the one-GPU run on this machine's GPUs (or gloo processes with
# --cpu): same global batches, loss curves compared by scripts/compare_runs.py.
set -uo pipefail

usage() {
  cat <<'USAGE'
usage: scripts/check_layouts.sh [options] OUT

Trains a dense and a MoE model once on one GPU and then in every parallel layout at each GPU
count of --worlds, all on the same global batches (training.data_sharding = "rows", local batch
1, gradient accumulation makes up the global batch), and compares each run's loss curve with
the one-GPU run's (scripts/compare_runs.py). Exit 1 if a run failed or left --rtol.

Layouts at each world size W: FSDP W, FSDP W in ZeRO-2 mode (reshard never), replicate W,
CP 2 x FSDP W/2, FSDP W with full activation checkpointing, TP 2 x FSDP W/2, TP 2 with float8
(tensorwise; against the bf16 run), TP 2 with async TP (not with --cpu), MoE with EP W; at W = 4 also HSDP 2x2, HSDP 2x2 x EP 2,
TP 2 x CP 2, PP 2 x CP 2, PP 2 x TP 2 and the MoE model at PP 2 x EP 2 and TP 2 x EP 2.
Pipeline parallel
needs untied embeddings: PP 2 (1F1B, eager and compiled), PP 2 x FSDP W/2 (GPipe at W = 4),
PP 2 x CP 2 and PP 2 x TP 2 train the 8B flavor cut to
--dense-layers blocks, against a one-GPU run of that model without compile (not with --cpu:
the debug flavors tie their embeddings); at W = 2 also PP 2 with float8 (against the bf16
run) and the MoE model with PP 2 (1F1B),
against the MoE one-GPU run (its aux loss is each micro-batch's: a small difference).

Writes OUT/<run>/ (metrics.jsonl, config.toml), OUT/<run>.log, and the verdict tables
OUT/compare_dense.md, OUT/compare_moe.md and OUT/compare_pp.md.

options:
  --worlds "2 4"       GPU counts to check (default "2 4"; each needs that many GPUs)
  --steps N            training steps (default 50)
  --global-batch N     rows per optimizer step (default 8; a multiple of every world size)
  --seq N              sequence length (default 2048)
  --dense-flavor F     dense model (default 0.6B) ...
  --dense-layers N     ... cut to N blocks (default 8)
  --moe-flavor F       MoE model (default 30B-A3B) ...
  --moe-layers N       ... cut to N blocks (default 4) ...
  --moe-experts N      ... with N experts (default 16)
  --rtol X             largest relative loss difference accepted (default 0.02: bf16 on GPUs)
  --timeout S          seconds per run (default 300)
  --only REGEX         run only the runs whose name matches (grep -E), e.g. 'dense_ref|tp2|pp';
                       a group is compared when its reference (dense_ref, moe_ref, pp_ref) ran
  --cpu                gloo processes instead of GPUs: debugmodel / debugmodel_moe, 2 blocks,
                       8 experts, seq 128, 5 steps, global batch 4 (options after it still
                       apply); about 5 minutes on 2 cores
  -h, --help           this text
USAGE
}

worlds="2 4" steps=50 gbs=8 seq=2048 rtol=0.02 limit=300
dense_flavor=0.6B dense_layers=8 moe_flavor=30B-A3B moe_layers=4 moe_experts=16
out="" only="" cpu=0
while [ $# -gt 0 ]; do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --worlds | --steps | --global-batch | --seq | --dense-* | --moe-* | --rtol | --timeout | --only)
      [ $# -ge 2 ] || { echo "check_layouts.sh: $1 needs a value (see --help)" >&2; exit 2; }
      ;;&
    --worlds) worlds=$2; shift ;;
    --steps) steps=$2; shift ;;
    --global-batch) gbs=$2; shift ;;
    --seq) seq=$2; shift ;;
    --dense-flavor) dense_flavor=$2; shift ;;
    --dense-layers) dense_layers=$2; shift ;;
    --moe-flavor) moe_flavor=$2; shift ;;
    --moe-layers) moe_layers=$2; shift ;;
    --moe-experts) moe_experts=$2; shift ;;
    --rtol) rtol=$2; shift ;;
    --timeout) limit=$2; shift ;;
    --only) only=$2; shift ;;
    --cpu)
      dense_flavor=debugmodel moe_flavor=debugmodel_moe dense_layers=2 moe_layers=2
      moe_experts=8 seq=128 steps=5 gbs=4 cpu=1
      ;;
    -*) echo "check_layouts.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *)
      [ -z "$out" ] || { echo "check_layouts.sh: one OUT folder, got '$out' and '$1'" >&2; exit 2; }
      out=$1
      ;;
  esac
  shift
done
[ -n "$out" ] || { usage >&2; exit 2; }

cd "$(dirname "$0")/.."
source scripts/setup_env.sh
mkdir -p "$out"

dense=(--job.config_file train_configs/qwen3_0.6b.toml --model.flavor "$dense_flavor"
       --model.n_layers "$dense_layers" --training.seq_len "$seq")
moe=(--job.config_file train_configs/qwen3_moe_1gpu.toml --model.flavor "$moe_flavor"
     --model.n_layers "$moe_layers" --model.num_experts "$moe_experts" --training.seq_len "$seq")
# Local batch 1, a fixed global batch and rows sharding: every world size trains on exactly the
# same rows per step. The plain loss keeps the comparison free of the chunk size.
common=(--training.steps "$steps" --training.global_batch_size "$gbs"
        --training.local_batch_size 1 --training.data_sharding rows --metrics.log_freq 1
        --lr_scheduler.warmup_steps 5 --checkpoint.enable false --training.loss_chunk_size 0)
# PP refuses tied embeddings (0.6B ties them): its runs train the untied 8B shapes.
untied=(--job.config_file train_configs/qwen3_0.6b.toml --model.flavor 8B
        --model.n_layers "$dense_layers" --training.seq_len "$seq" --compile.enable false)
P=--parallelism
dense_runs=() moe_runs=() pp_runs=()

train() {  # train NAME NGPU dense|moe [--section.key value ...]
  local name=$1 ngpu=$2 model=$3
  shift 3
  local -a model_args
  case $model in
    dense) model_args=("${dense[@]}") ;;
    untied) model_args=("${untied[@]}") ;;
    *) model_args=("${moe[@]}") ;;
  esac
  if [ -n "$only" ] && ! grep -qE "$only" <<<"$name"; then return; fi
  # --cpu trains the debug flavors, which tie their embeddings: no pipeline parallel there.
  if [ "$cpu" = 1 ] && { [ "$model" = untied ] || [[ " $* " == *pipeline_parallel_degree* ]]; }; then
    return
  fi
  case $name in
    *_ref) ;;
    dense_*) dense_runs+=("$out/$name") ;;
    pp*) pp_runs+=("$out/$name") ;;
    *) moe_runs+=("$out/$name") ;;
  esac
  echo "$name: $ngpu process(es)"
  NGPU=$ngpu timeout "$limit" ./run_train.sh "${model_args[@]}" "${common[@]}" \
    --job.dump_folder "$out/$name" "$@" >"$out/$name.log" 2>&1 \
    || echo "$name failed (see $out/$name.log)"
}

train dense_ref 1 dense
train moe_ref 1 moe
train pp_ref 1 untied
for w in $worlds; do
  train "dense_fsdp$w" "$w" dense
  train "dense_fsdp${w}_never" "$w" dense $P.fsdp_reshard_after_forward never
  train "dense_replicate$w" "$w" dense $P.data_parallel_replicate_degree "$w" \
    $P.data_parallel_shard_degree 1
  train "dense_cp2_w$w" "$w" dense $P.context_parallel_degree 2
  train "dense_fsdp${w}_ac_full" "$w" dense --activation_checkpoint.mode full
  train "dense_tp2_w$w" "$w" dense $P.tensor_parallel_degree 2
  train "moe_ep$w" "$w" moe $P.expert_parallel_degree "$w"
  # Local batch 4 in micro-batches of 1: the schedule has 4 (or 8) micro-batches to overlap.
  pp=($P.pipeline_parallel_degree 2 --training.local_batch_size 4)
  if [ "$w" = 2 ]; then
    train pp2 2 untied "${pp[@]}"
    train pp2_compiled 2 untied "${pp[@]}" --compile.enable true
    train moe_pp2 2 moe "${pp[@]}"  # 30B-A3B's shapes are untied; compiled, aux loss on
  else
    train "pp2_fsdp$((w / 2))_gpipe" "$w" untied "${pp[@]}" $P.pipeline_parallel_schedule GPipe
  fi
  train "dense_tp2_float8_w$w" "$w" dense $P.tensor_parallel_degree 2 --float8.enable true
  # Async TP: the micro-pipelined collectives (CUDA symmetric memory; not with --cpu).
  [ "$cpu" = 1 ] || train "dense_tp2_async_w$w" "$w" dense $P.tensor_parallel_degree 2 \
    $P.enable_async_tensor_parallel true
  [ "$w" = 2 ] && train pp2_float8 2 untied "${pp[@]}" --float8.enable true
  if [ "$w" = 4 ]; then
    train dense_hsdp2x2 4 dense $P.data_parallel_replicate_degree 2 $P.data_parallel_shard_degree 2
    train moe_hsdp2x2_ep2 4 moe $P.data_parallel_replicate_degree 2 \
      $P.data_parallel_shard_degree 2 $P.expert_parallel_degree 2
    train dense_tp2_cp2 4 dense $P.tensor_parallel_degree 2 $P.context_parallel_degree 2
    train pp2_cp2 4 untied "${pp[@]}" $P.context_parallel_degree 2
    train pp2_tp2 4 untied "${pp[@]}" $P.tensor_parallel_degree 2
    train moe_pp2_ep2 4 moe "${pp[@]}" $P.expert_parallel_degree 2
    # Attention by TP, experts by EP over the ranks of one tp coordinate.
    train moe_tp2_ep2 4 moe $P.tensor_parallel_degree 2 $P.expert_parallel_degree 2
  fi
done

rc=0
compare() {  # compare GROUP RUN...: each run's loss curve against OUT/GROUP_ref's
  local group=$1
  shift
  [ -d "$out/${group}_ref" ] && [ $# -gt 0 ] || return 0
  "$PYTHON" scripts/compare_runs.py "$out/${group}_ref" "$@" --rtol "$rtol" \
    | tee "$out/compare_$group.md"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
}
compare dense "${dense_runs[@]}"
compare moe "${moe_runs[@]}"
compare pp "${pp_runs[@]}"
exit $rc
