#!/usr/bin/env bash
# The test command: sets up the dev extras on first use, then runs pytest (GPU tests skip on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev source scripts/setup_env.sh
exec "$PYTHON" -m pytest -q -m "not gpu" "$@"
