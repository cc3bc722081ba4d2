#!/usr/bin/env bash
# Measuring tool only: an OURS_PYTHON for scripts/peer_bench.sh that runs the dev/ tool named by
# ENTRY in place of `-m torchtitan_ablate.train` (other python calls pass through), e.g.
#   ENGINES=ours OURS_PYTHON=$PWD/dev/ours_python.sh ENTRY=dev/price_nonfinite_sync.py \
#     scripts/peer_bench.sh dense
if [ "$1" = -m ] && [ "$2" = torchtitan_ablate.train ]; then
  shift 2
  exec "${PYTHON_BIN:-python3}" "$ENTRY" "$@"
fi
exec "${PYTHON_BIN:-python3}" "$@"
