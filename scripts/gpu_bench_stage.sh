#!/usr/bin/env bash
# GPU measurements for docs/performance_sessions_*.md, grouped by device call (see docs/LOG.md).
#   source scripts/device_setup.sh; bash scripts/gpu_bench_stage.sh STAGE OUTDIR
# Every run's full log lands in OUTDIR/<name>.log; the tables are printed at the end.
set -u
stage=$1 out=$2
mkdir -p "$out"
B="python3 scripts/bench.py --steps 8 --warmup 3"
q06=train_configs/qwen3_0.6b.toml q17=train_configs/qwen3_1.7b.toml
run() {  # run NAME TIMEOUT_S CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*" | tee -a "$out/summary.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" --job.dump_folder "$out/$name" >"$out/$name.log" 2>&1
  echo "exit $? after $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
  grep -E '^\||^profile:|^host syncs|^sync x|^allocator|^engine /|out of memory|Error' "$out/$name.log" | grep -v '^| kernel |' \
    | head -80 >>"$out/summary.txt"
}
# The parallelism issue's float8 check: the shipped 1.7B recipe for 20 steps, loss every 2.
F8_17="--job.config_file $q17 --training.steps 20 --metrics.log_freq 2"
BIG="--training.dataset_path /tmp/big_corpus.jsonl"
big_corpus() {  # the shipped generator's 60,000 documents (4.2M tokens): no repeats in a run
  python3 scripts/make_debug_assets.py --corpus-docs 60000 --corpus-out /tmp/big_corpus.jsonl --seed 7
}
train() {  # train NAME TIMEOUT_S ARGS...: run_train.sh, then its losses as one line
  local name=$1 limit=$2; shift 2
  timeout "$limit" ./run_train.sh --job.dump_folder "$out/$name" "$@" >"$out/$name.log" 2>&1 \
    || echo "$name failed" >>"$out/summary.txt"
  python3 -c "import json,sys; print(sys.argv[2], [round(json.loads(l)['loss'],3) for l in open(sys.argv[1])])" \
    "$out/$name/metrics.jsonl" "$name" >>"$out/summary.txt" 2>&1
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/summary.txt"
for st in ${stage//,/ }; do
case $st in
a)
  run q06_profile 200 $B --job.config_file $q06 --profile
  run q06_chunk_b8_profile 170 $B --job.config_file $q06 --training.local_batch_size 8 \
    --training.loss_chunk_size 8192 --profile
  run q06_peer_hf_compiled 220 $B --job.config_file $q06 --peer hf --peer-compile
  ;;
b)
  timeout 240 python3 scripts/bench_attention.py --flavor 0.6B --batch 4 --seq 4096 \
    2>&1 | tee "$out/attention.log" | grep -E '^\||B=' >>"$out/summary.txt"
  run q06_varlen 150 $B --job.config_file $q06 --model.attn_backend varlen
  run q06_flex 150 $B --job.config_file $q06 --model.attn_backend flex
  run q17_peer_hf_compiled 240 $B --job.config_file $q17 --peer hf --peer-compile
  ;;
c)
  run q06_auto_profile 150 $B --job.config_file $q06 --profile
  run q06_never 120 $B --job.config_file $q06 --parallelism.fsdp_reshard_after_forward never
  run q06_b8_plain 150 $B --job.config_file $q06 --training.local_batch_size 8
  run q06_b8_chunk8192 150 $B --job.config_file $q06 --training.local_batch_size 8 \
    --training.loss_chunk_size 8192
  run q06_b8_chunk2048 150 $B --job.config_file $q06 --training.local_batch_size 8 \
    --training.loss_chunk_size 2048
  run q17_auto 150 $B --job.config_file $q17
  run q17_never 120 $B --job.config_file $q17 --parallelism.fsdp_reshard_after_forward never
  run moe1_profile 200 $B --job.config_file train_configs/qwen3_moe_1gpu.toml --profile
  run q4_bf16 150 $B --job.config_file train_configs/qwen3_4b_float8.toml --float8.enable false
  run q4_float8 150 $B --job.config_file train_configs/qwen3_4b_float8.toml
  ;;
d)
  moe=train_configs/qwen3_moe_1gpu.toml q4=train_configs/qwen3_4b_float8.toml
  never="--parallelism.fsdp_reshard_after_forward never"
  run moe1_b8_never_profile 150 $B --job.config_file $moe --training.local_batch_size 8 $never --profile
  run moe1_b4_never 120 $B --job.config_file $moe --training.local_batch_size 4 $never
  run q4_bf16_exp 120 $B --job.config_file $q4 --float8.enable false
  run q4_float8_exp 120 $B --job.config_file $q4
  run q17_b4_chunk_never 120 $B --job.config_file $q17 --training.local_batch_size 4 \
    --training.loss_chunk_size 8192 $never
  run q06_b4_peer 200 $B --job.config_file $q06 --training.local_batch_size 4 --peer hf --peer-compile
  run q17_b2_never_peer 220 $B --job.config_file $q17 $never --peer hf --peer-compile
  ;;
e)
  moe=train_configs/qwen3_moe_1gpu.toml
  timeout 420 python3 scripts/validate_estimator.py --configs \
    "$q06 --training.local_batch_size 4" \
    "$q06 --training.local_batch_size 4 --training.loss_chunk_size 0" \
    "$q06 --training.local_batch_size 4 --activation_checkpoint.mode full" \
    "$q06 --training.local_batch_size 4 --activation_checkpoint.mode selective" \
    "$q06 --training.local_batch_size 2" \
    "$q06 --training.local_batch_size 4 --training.seq_len 2048" \
    "$q06 --training.local_batch_size 4 --float8.enable true" \
    "$q06 --training.local_batch_size 4 --training.packing padding" \
    "$q17 --training.local_batch_size 2" \
    "$q17 --training.local_batch_size 2 --activation_checkpoint.mode full" \
    "$q17 --training.local_batch_size 1 --training.seq_len 8192" \
    "$moe --training.local_batch_size 2" \
    "$moe --training.local_batch_size 2 --activation_checkpoint.mode full" \
    >"$out/validate.log" 2>&1
  echo "validate exit $?" >>"$out/summary.txt"
  grep -vE "Warning|warn|^  |^\[" "$out/validate.log" | tail -20 >>"$out/summary.txt"
  ;;
f)
  bash scripts/gpu_finetune_check.sh "$out/ft" >>"$out/summary.txt" 2>&1
  rm -rf "$out/ft/hf06"
  ;;
f8)
  # Parallelism issue: bf16 vs float8 on the shipped Qwen3-1.7B config, 20 steps.
  f8=$F8_17
  train f8_bf16 150 $f8
  train f8_tensorwise 150 $f8 --float8.enable true
  train f8_rowwise 150 $f8 --float8.enable true --float8.recipe rowwise
  python3 scripts/summarize_runs.py "$out"/f8_bf16 "$out"/f8_tensorwise "$out"/f8_rowwise >>"$out/summary.txt"
  ;;
abl1 | abl2)
  # Ablation issue: the five GPU studies at Qwen3-0.6B (report.md + plots per study).
  studies="chunked_vs_plain_loss ac_modes compile_on_off"
  [ "$st" = abl2 ] && studies="packing_vs_padding attention_backends"
  for s in $studies; do
    steps=20; [ "$s" = packing_vs_padding ] && steps=30
    timeout 330 python3 scripts/ablate.py train_configs/ablations/$s.toml --out "$out/$s" \
      --set training.steps=$steps --timeout 150 >"$out/$s.log" 2>&1
    echo "$s exit $?" >>"$out/summary.txt"
    grep -A12 "^| variant" "$out/$s/report.md" | head -14 >>"$out/summary.txt"
  done
  ;;
g)
  # Session 3, performance issue: chunked vs plain loss with AC full (the loss is then the
  # largest activation), and float8 on 4B with AC full at batch 4 (matmul-bound, room to spare).
  q4=train_configs/qwen3_4b_float8.toml full="--activation_checkpoint.mode full"
  run q06_b8_full_chunk 100 $B --job.config_file $q06 --training.local_batch_size 8 $full
  run q06_b8_full_plain 100 $B --job.config_file $q06 --training.local_batch_size 8 $full \
    --training.loss_chunk_size 0
  run q06_b8_full_plain_eagerloss 100 $B --job.config_file $q06 --training.local_batch_size 8 \
    $full --training.loss_chunk_size 0 --compile.components model
  run q4_bf16_full_b4 170 $B --job.config_file $q4 --float8.enable false $full \
    --training.local_batch_size 4 --profile
  run q4_tensorwise_full_b4 170 $B --job.config_file $q4 $full --training.local_batch_size 4 --profile
  run q4_rowwise_full_b4 150 $B --job.config_file $q4 $full --training.local_batch_size 4 \
    --float8.recipe rowwise --float8.enable_fsdp_float8_all_gather false
  ;;
h)
  # Performance issue: float8 vs bf16 over 100 steps on the shipped 4B config; chunked loss
  # with smaller chunks. Parallelism issue: float8 at step 20 on 1.7B, other recipe and seed.
  q4=train_configs/qwen3_4b_float8.toml
  train q4_100_bf16 200 --job.config_file $q4 --training.steps 100 --metrics.log_freq 5 \
    --float8.enable false
  train q4_100_tensorwise 200 --job.config_file $q4 --training.steps 100 --metrics.log_freq 5
  python3 scripts/summarize_runs.py "$out"/q4_100_* >>"$out/summary.txt"
  run q06_b8_full_chunk4096 100 $B --job.config_file $q06 --training.local_batch_size 8 \
    --activation_checkpoint.mode full --training.loss_chunk_size 4096
  run q06_b8_chunk4096 100 $B --job.config_file $q06 --training.local_batch_size 8 \
    --training.loss_chunk_size 4096
  run q06_b8_plain_eagerloss 100 $B --job.config_file $q06 --training.local_batch_size 8 \
    --training.loss_chunk_size 0 --compile.components model
  f8=$F8_17
  train f8_gw_hp 150 $f8 --float8.enable true --float8.recipe rowwise_with_gw_hp
  train f8_bf16_seed1 150 $f8 --training.seed 1
  train f8_tensorwise_seed1 150 $f8 --training.seed 1 --float8.enable true
  ;;
i)
  # Float8 vs bf16 loss on a corpus that does not repeat within the run (the shipped 650
  # documents repeat every ~3 steps, so the runs above compare memorisation).
  big_corpus
  f8="$F8_17 $BIG"
  train big17_bf16 150 $f8
  train big17_tensorwise 150 $f8 --float8.enable true
  q4="--job.config_file train_configs/qwen3_4b_float8.toml --training.steps 100 --metrics.log_freq 5 $BIG"
  train big4_bf16 200 $q4 --float8.enable false
  train big4_tensorwise 200 $q4
  python3 scripts/summarize_runs.py "$out"/big17_*/ "$out"/big4_*/ >>"$out/summary.txt"
  ;;
j)
  # Seed spread of the step-20 comparison on 1.7B (non-repeating corpus); MoE with gradient
  # accumulation (the optimizer step over 3.2B parameters amortised over 4 micro-batches).
  big_corpus
  f8="$F8_17 $BIG"
  for seed in 1 2; do
    train big17_bf16_seed$seed 100 $f8 --training.seed $seed
    train big17_tensorwise_seed$seed 100 $f8 --training.seed $seed --float8.enable true
  done
  run moe1_b2_ga4 130 $B --job.config_file train_configs/qwen3_moe_1gpu.toml \
    --training.local_batch_size 2 --training.global_batch_size 8
  ;&
gpu_tests)
  timeout 300 python3 -m pytest -m gpu -q tests >"$out/pytest_gpu.log" 2>&1
  echo "pytest -m gpu exit $?" >>"$out/summary.txt"
  tail -15 "$out/pytest_gpu.log" >>"$out/summary.txt"
  ;;
k)
  # Next: where the MoE step goes with accumulation (the 40% MFU target).
  run moe1_ga4_profile 200 $B --job.config_file train_configs/qwen3_moe_1gpu.toml --profile
  ;;
l)
  # MoE with the weights gathered and the gradients reduced once per step (session 4):
  # how deep must accumulation go to amortise the optimizer and the last reduce?
  M="$B --job.config_file train_configs/qwen3_moe_1gpu.toml --training.local_batch_size 2"
  run moe1_ga4 150 $M --training.global_batch_size 8
  run moe1_ga8 130 $M --training.global_batch_size 16
  run moe1_ga16 140 $M --training.global_batch_size 32 --steps 5 --warmup 2
  run moe1_ga8_profile 130 $M --training.global_batch_size 16 --steps 3 --warmup 2 --profile
  ;;
n)
  # MoE row movements without accumulating backward passes (session 4): before (.baseline,
  # the previous commit, carried beside the tree) and after on the same machine.
  M="--job.config_file train_configs/qwen3_moe_1gpu.toml --training.local_batch_size 2"
  if [ -d .baseline ]; then (cd .baseline && run moe1_ga8_before 130 $B $M --training.global_batch_size 16); fi
  run moe1_ga8_after 100 $B $M --training.global_batch_size 16
  run moe1_ga16_after 100 $B $M --training.global_batch_size 32 --steps 5 --warmup 2
  run moe1_ga8_profile 100 $B $M --training.global_batch_size 16 --steps 3 --warmup 2 --profile
  timeout 200 python3 -m pytest -m gpu -q tests/unit/models tests/unit/distributed/test_float8.py \
    >"$out/pytest_gpu_moe.log" 2>&1
  echo "pytest -m gpu (models, float8) exit $?" >>"$out/summary.txt"
  tail -5 "$out/pytest_gpu_moe.log" >>"$out/summary.txt"
  ;;
o)
  # Where the MoE step's host syncs come from (GPU idle ~11% of the step, session 4).
  run moe1_ga8_syncs 100 $B --job.config_file train_configs/qwen3_moe_1gpu.toml \
    --training.local_batch_size 2 --training.global_batch_size 16 --steps 2 --warmup 2 --profile
  ;;
p)
  # MoE: are the step's 40 stream syncs the allocator's (frees and retries at 78 of 80 GB)?
  M="$B --job.config_file train_configs/qwen3_moe_1gpu.toml --training.local_batch_size 2"
  run moe1_ga8_alloc 100 $M --training.global_batch_size 16
  run moe1_ga8_no_expandable 100 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False \
    $M --training.global_batch_size 16
  # float8 step 20 on 1.7B, the two seeds furthest from bf16 (+6.9%, +10.1% tensorwise):
  # rowwise recipes (e4m3 gradients, row scales) and tensorwise with the first and last
  # blocks kept in bf16.
  big_corpus
  f8="$F8_17 $BIG --float8.enable true"
  ends="output,router,layers.0.,layers.27."
  for seed in 42 3; do
    train big17_rowwise_seed$seed 100 $f8 --training.seed $seed --float8.recipe rowwise
    train big17_tw_ends_bf16_seed$seed 100 $f8 --training.seed $seed --float8.filter_fqns $ends
  done
  train big17_gw_hp_seed42 100 $f8 --float8.recipe rowwise_with_gw_hp
  ;;
q)
  # One-rank reduce-scatter buffers from the training stream's pool (session 4): before
  # (.baseline, the previous commit) and after, same machine; then the GPU tests.
  M="--job.config_file train_configs/qwen3_moe_1gpu.toml --training.local_batch_size 2"
  if [ -d .baseline ]; then
    (cd .baseline && run moe1_ga8_before 100 $B $M --training.global_batch_size 16 \
      && run q17_before 100 $B --job.config_file $q17)
  fi
  run moe1_ga8_after 100 $B $M --training.global_batch_size 16
  run q17_after 100 $B --job.config_file $q17
  run moe1_ga16_after 100 $B $M --training.global_batch_size 32 --steps 5 --warmup 2
  run q06_after 100 $B --job.config_file $q06
  ;;
r)
  # MoE against transformers' compiled MoE on its fast path (pure bf16 weights: grouped_mm
  # experts), at the shipped accumulation; profile of what is left. Then the step-20 float8
  # check: is bf16 itself stable there (another attention kernel), and rowwise_with_gw_hp.
  M="$B --job.config_file train_configs/qwen3_moe_1gpu.toml --steps 5 --warmup 2"
  run moe1_peer_bf16 200 $M --peer hf --peer-compile --peer-bf16-weights
  run moe1_profile 100 $M --profile
  big_corpus
  f8="$F8_17 $BIG"
  for seed in 3 1; do
    train big17_bf16_sdpa_seed$seed 100 $f8 --training.seed $seed --model.attn_backend sdpa
    train big17_gw_hp_seed$seed 100 $f8 --training.seed $seed --float8.enable true \
      --float8.recipe rowwise_with_gw_hp
  done
  ;;
s)
  # MoE with float8: rowwise linears + float8 grouped GEMMs for the experts (against the pure
  # bf16 compiled transformers peer in the same run), and tensorwise linears only.
  M="$B --job.config_file train_configs/qwen3_moe_1gpu.toml --steps 5 --warmup 2 --float8.enable true"
  run moe1_f8_rowwise_moe 250 $M --float8.recipe rowwise --float8.moe true \
    --peer hf --peer-compile --peer-bf16-weights
  run moe1_f8_tensorwise 100 $M
  ;;
t)
  # Does float8's step-20 lag on 1.7B (seed 3: +10%) close by step 100?
  big_corpus
  f100="--job.config_file $q17 --training.steps 100 --metrics.log_freq 10 $BIG --training.seed 3"
  train big17_100_bf16_seed3 150 $f100
  train big17_100_tensorwise_seed3 150 $f100 --float8.enable true
  ;;
u)
  # The float8 check on the shipped 1.7B recipe's first steps (warmup 100: a 100-step run has
  # the same lr at every step as the 1000-step recipe), not a 20-step run (whose warmup is
  # squeezed into those 20 steps and reaches peak lr at step 20, the most chaotic point).
  # Seed 3 is stage t.
  big_corpus
  f100="--job.config_file $q17 --training.steps 100 --metrics.log_freq 2 $BIG"
  for seed in 42 1 2; do
    train ship17_bf16_seed$seed 100 $f100 --training.seed $seed
    train ship17_tensorwise_seed$seed 100 $f100 --training.seed $seed --float8.enable true
  done
  ;;
m)
  # The float8 step-20 check: how far apart are two bf16 programs of the same math at step 20
  # (the same run again; another attention kernel), and float8 again / on one more seed.
  big_corpus
  f8="$F8_17 $BIG"
  train big17_bf16_again 100 $f8
  train big17_bf16_sdpa 100 $f8 --model.attn_backend sdpa
  train big17_tensorwise_again 100 $f8 --float8.enable true
  train big17_bf16_seed3 100 $f8 --training.seed 3
  train big17_tensorwise_seed3 100 $f8 --training.seed 3 --float8.enable true
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
done
cat "$out/summary.txt"
