#!/usr/bin/env bash
# Launcher: ./run_train.sh [--section.key value ...]
#   CONFIG_FILE  TOML recipe (default train_configs/debug_model.toml)
#   NGPU         processes per node (default: visible GPUs, else 1; on CPU: gloo processes)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT  multi-node torchrun rendezvous (one node
#                without MASTER_PORT: a free port)
set -euo pipefail
cd "$(dirname "$0")"
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}
# Help and the config's own checks need only the package's config code: no environment, no torch
# (each torch import below takes seconds), so a typo is one line and exit code 2 at once. A python
# that cannot run this check (say 3.10 without tomli) leaves it to the trainer.
light=(env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" -m)
for arg in "$@"; do
  if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then
    exec "${light[@]}" torchtitan_ablate.config.help "$@"
  fi
done
config=(--job.config_file "$CONFIG_FILE" "$@")
if checked=$("${light[@]}" torchtitan_ablate.config.precheck "${config[@]}" 2>&1); then
  :
elif [ $? = 2 ]; then
  echo "$checked" >&2
  exit 2
fi
source scripts/setup_env.sh

if [ -z "${NGPU:-}" ]; then
  NGPU=$("$PYTHON" -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
# One node and no MASTER_PORT: no port is passed, and torchrun then rendezvouses on a free one
# (localhost:0, as --standalone), so a second job on the same machine does not crash on 29500.
rdzv=()
if [ "$NNODES" != "1" ] || [ -n "${MASTER_PORT:-}" ]; then
  rdzv=(--master_addr="${MASTER_ADDR:-localhost}" --master_port="${MASTER_PORT:-29500}")
fi

if [ "$NGPU" = "1" ] && [ "$NNODES" = "1" ]; then
  exec "$PYTHON" -m torchtitan_ablate.train --job.config_file "$CONFIG_FILE" "$@"
fi
# torchtitan_ablate.launch is torchrun plus one-line errors from every rank (LOG_RANK picks the
# ranks whose output is shown) and the config checked before any worker starts. On SIGTERM
# torchrun forwards the signal; the workers stop at the next step and save a checkpoint, with
# this many seconds before torchrun kills them (torch's default, 30, is short for a large save).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}
exec "$PYTHON" -m torchtitan_ablate.launch \
  --nproc_per_node="$NGPU" --nnodes="$NNODES" --node_rank="$NODE_RANK" "${rdzv[@]}" \
  --local-ranks-filter="${LOG_RANK:-0}" --role=rank --tee=3 \
  -m torchtitan_ablate.train --job.config_file "$CONFIG_FILE" "$@"
