#!/usr/bin/env bash
# Multi-GPU measurements for docs/multi_gpu.md (the multi-GPU issue), one stage per device call.
#   source scripts/device_setup.sh; bash scripts/gpu_multi_stage.sh STAGE OUTDIR
# Stages:
#   correct  every layout of the CPU equivalence suite at 2 and 4 ranks against the 1-rank run,
#            same global batch, bf16, 50 steps; prints the loss-curve comparison.
#   scaling  Qwen3-1.7B FSDP tokens/s per GPU at 1, 2, 4 GPUs (weak scaling: local batch fixed).
# DENSE / MOE / STEPS / GBS pick the models (defaults: Qwen3-0.6B shapes with 8 layers, the
# one-GPU MoE with 4 layers); on a CPU machine NGPU ranks are gloo processes, so the same script
# checks its own plumbing there with DENSE_FLAVOR=debugmodel MOE_FLAVOR=debugmodel_moe.
set -u
stage=$1 out=$2
mkdir -p "$out"
steps=${STEPS:-50} gbs=${GBS:-8}
dense=(--job.config_file train_configs/qwen3_0.6b.toml --model.flavor "${DENSE_FLAVOR:-0.6B}"
       --model.n_layers "${DENSE_LAYERS:-8}" --training.seq_len "${SEQ:-2048}")
moe=(--job.config_file train_configs/qwen3_moe_1gpu.toml --model.flavor "${MOE_FLAVOR:-30B-A3B}"
     --model.n_layers "${MOE_LAYERS:-4}" --model.num_experts "${MOE_EXPERTS:-16}"
     --training.seq_len "${SEQ:-2048}")
# Local batch 1, a fixed global batch and rows sharding: every world size trains on exactly the
# same rows per step (gradient accumulation makes up the rest).
common=(--training.steps "$steps" --training.global_batch_size "$gbs" --training.local_batch_size 1
        --training.data_sharding rows --metrics.log_freq 1
        --lr_scheduler.warmup_steps 5 --checkpoint.enable false --training.loss_chunk_size 0)
P=--parallelism
train() {  # train NAME NGPU MODEL_ARRAY_NAME [overrides...]
  local name=$1 ngpu=$2; local -n model=$3; shift 3
  NGPU=$ngpu timeout 300 ./run_train.sh "${model[@]}" "${common[@]}" \
    --job.dump_folder "$out/$name" "$@" >"$out/$name.log" 2>&1 || echo "$name failed (see $name.log)"
}
case $stage in
correct)
  train dense_ref 1 dense
  train moe_ref 1 moe
  for w in ${WORLDS:-2 4}; do  # WORLDS=2 / WORLDS=4 splits the stage over two device calls
    train "dense_fsdp$w" $w dense
    train "dense_fsdp${w}_never" $w dense $P.fsdp_reshard_after_forward never
    train "dense_replicate$w" $w dense $P.data_parallel_replicate_degree $w $P.data_parallel_shard_degree 1
    train "dense_cp2_w$w" $w dense $P.context_parallel_degree 2
    train "dense_fsdp${w}_ac_full" $w dense --activation_checkpoint.mode full
    train "moe_ep$w" $w moe $P.expert_parallel_degree $w
  done
  if [[ " ${WORLDS:-2 4} " == *" 4 "* ]]; then
    train dense_hsdp2x2 4 dense $P.data_parallel_replicate_degree 2 $P.data_parallel_shard_degree 2
    train moe_hsdp2x2_ep2 4 moe $P.data_parallel_replicate_degree 2 $P.data_parallel_shard_degree 2 \
      $P.expert_parallel_degree 2
  fi
  for m in dense moe; do
    runs=$(ls -d "$out/${m}_"*/ | grep -v "/${m}_ref/")
    python3 scripts/compare_runs.py "$out/${m}_ref" $runs --rtol "${RTOL:-0.02}" | tee "$out/compare_$m.md"
  done
  ;;
scaling)
  for w in 1 2 4; do
    NGPU=$w timeout 300 ./run_train.sh --job.config_file train_configs/qwen3_1.7b.toml \
      --training.steps 20 --metrics.log_freq 5 --job.dump_folder "$out/q17_fsdp$w" \
      >"$out/q17_fsdp$w.log" 2>&1 || echo "q17_fsdp$w failed"
  done
  python3 scripts/summarize_runs.py "$out"/q17_fsdp1 "$out"/q17_fsdp2 "$out"/q17_fsdp4 | tee "$out/scaling.md"
  ;;
*) echo "unknown stage $stage (correct, scaling)"; exit 2 ;;
esac
