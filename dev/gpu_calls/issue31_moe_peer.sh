#!/usr/bin/env bash
# Issue 31 on 4 GPUs (H100s, or H200s with GPU_MEMORY_CAP_GIB=79.1): this engine and
# torchtitan 0.2.2 side by side on the benchmark corpus (carry .whl and .peer: a copy of
# ../shared/peers/torchtitan). One call per PART:
#   PART=8   8 layers, batch 4: natural routing, then forced balance
#   PART=12  12 layers, batch 3 (the recipe's): natural, then forced; 50 steps (natural vs
#            forced from step 30 on)
set -uo pipefail
source dev/gpu_calls/common.sh
export PEER_DIR=$PWD/.peer/torchtitan LOG_FREQ=5 FROM_STEP=10 RESULTS_DIR=$OUT/peer
export GPU_MEMORY_CAP_GIB=${GPU_MEMORY_CAP_GIB:-}
case "${PART:?PART=8|12}" in
8)  export LAYERS=8 LBS=4 STEPS=30 ;;
12) export LAYERS=12 LBS=3 STEPS=50 FROM_STEP=30 ;;
esac
run natural 290 bash scripts/peer_bench.sh moe
run forced 290 env FORCE_BALANCE=1 OURS_ARGS="--debug.moe_force_load_balance true" \
  bash scripts/peer_bench.sh moe
grep -h -E "tokens/s|ratio|load|reserved" "$OUT"/natural.log "$OUT"/forced.log | tail -n 30
