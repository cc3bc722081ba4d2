#!/usr/bin/env bash
# usage: scripts/peer_bench.sh moe|dense
#
# The torchtitan peer run (run_peer.sh of shared/peers/torchtitan) on the real-text benchmark
# corpus: builds it with scripts/make_bench_corpus.py when missing or stale, then runs both
# engines on its train.jsonl and on its tokenizer/ folder, whose tokenizer.json both load
# (make_bench_corpus.py checks that they give the same ids where `tokenizers` is installed).
#
# Environment (all optional; the rest, e.g. STEPS LBS LAYERS FORCE_BALANCE MATCH_LB ENGINES
# RUN_TIMEOUT TTPEER_CPU, reaches run_peer.sh unchanged, see its header):
#   PEER_DIR=DIR        the peer folder (default: shared/peers/torchtitan in this checkout,
#                       else ../shared/peers/torchtitan beside it)
#   BENCH_CORPUS=DIR    the corpus folder (default outputs/bench_corpus)
#   ATTN=flex|sdpa      torchtitan's attention (default flex: a corpus of short and long
#                       documents packs several into a row, and flex masks per document as
#                       torchtitan_ablate does; sdpa attends across them, more work)
#   TT_ARGS, OURS_ARGS  extra overrides, after the corpus' tokenizer (paths without spaces);
#                       MoE: this engine runs with model.moe_bias_update_rate 0, as torchtitan
#                       0.2.2's Qwen3 trains (its expert bias never moves), unless OURS_ARGS sets it
#   GPU_MEMORY_CAP_GIB=G  cap every rank's CUDA allocator of both engines at G GiB
#                       (scripts/peer/gpu_cap): an 80 GB recipe measured on an H200 as on an
#                       H100 (79.1 = an H100's memory as torch reports it)
# Speed figures compare only at the same corpus content_hash (printed first and last).
set -uo pipefail

case "${1:-}" in
  moe|dense) ;;
  -h|--help) sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
PY="${PYTHON:-python3}"
if [ -z "${PEER_DIR:-}" ]; then
  for d in "$ROOT/shared/peers/torchtitan" "$ROOT/../shared/peers/torchtitan"; do
    [ -f "$d/run_peer.sh" ] && PEER_DIR="$d" && break
  done
fi
if [ ! -f "${PEER_DIR:-}/run_peer.sh" ]; then
  echo "peer_bench: no run_peer.sh in PEER_DIR=${PEER_DIR:-} (set PEER_DIR to the peer folder)" >&2
  exit 2
fi

CORPUS="$(mkdir -p "${BENCH_CORPUS:-outputs/bench_corpus}" && cd "${BENCH_CORPUS:-outputs/bench_corpus}" && pwd)"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" scripts/make_bench_corpus.py --out "$CORPUS" || exit
HASH=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["content_hash"])' "$CORPUS/manifest.json")
echo "[peer_bench] corpus $CORPUS, content_hash $HASH"

# TTPEER_CORPUS reaches torchtitan_ablate; torchtitan's recipe reads the peer's own assets/data
# unless told otherwise, so its data path is given too.
export TTPEER_CORPUS="$CORPUS/train.jsonl" ATTN="${ATTN:-flex}"
# scripts/peer/ttpeer_expert_load.py logs torchtitan's expert load (it loads the peer's flavors).
export PYTHONPATH="$ROOT/scripts/peer${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${GPU_MEMORY_CAP_GIB:-}" ]; then
  export GPU_MEMORY_CAP_GIB PYTHONPATH="$ROOT/scripts/peer/gpu_cap:$PYTHONPATH"
  echo "[peer_bench] CUDA allocator capped at $GPU_MEMORY_CAP_GIB GiB per rank (both engines)"
fi
export TT_ARGS="--model.hf_assets_path $CORPUS/tokenizer --training.dataset_path $TTPEER_CORPUS \
--experimental.custom_import ttpeer_expert_load ${TT_ARGS:-}"
# torchtitan 0.2.2's Qwen3 never updates its expert bias (it builds its optimizers without the
# load-balancing hook; ttpeer_expert_load prints the bias): this engine runs without one too
# (run_peer.sh's MATCH_LB sets 1e-3 and no aux loss; OURS_ARGS may set a rate again).
BALANCE=""; [ "$1" = moe ] && BALANCE="--model.moe_bias_update_rate 0"
export OURS_ARGS="--model.tokenizer_path $CORPUS/tokenizer $BALANCE ${OURS_ARGS:-}"
bash "$PEER_DIR/run_peer.sh" "$1"
rc=$?
echo "[peer_bench] corpus content_hash $HASH"
exit $rc
