#!/usr/bin/env bash
# The test command: sets up the dev extras on first use, then runs pytest (GPU tests skip on CPU).
set -euo pipefail
case "${1:-}" in
  -h | --help)
    cat <<'USAGE'
usage: scripts/run_tests.sh [PYTEST_ARGS ...]

Runs the test suite (pytest -q -m "not gpu"), creating .venv with the dev extras on first use.
Arguments go to pytest, e.g. scripts/run_tests.sh tests/unit -x -k estimator.
GPU tests: .venv/bin/python -m pytest -m gpu tests (on a machine with CUDA).
USAGE
    exit 0
    ;;
esac
cd "$(dirname "$0")/.."
EXTRAS=dev source scripts/setup_env.sh
exec "$PYTHON" -m pytest -q -m "not gpu" "$@"
