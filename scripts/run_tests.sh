#!/usr/bin/env bash
# The test command: sets up the dev extras on first use, then runs pytest (GPU tests skip on CPU)
# in parallel worker processes (pytest-xdist).
set -euo pipefail
case "${1:-}" in
  -h | --help)
    cat <<'USAGE'
usage: scripts/run_tests.sh [PYTEST_ARGS ...]

Runs the test suite (pytest -q -m "not gpu"), creating .venv with the dev extras on first use.
The tests run in parallel processes (pytest-xdist): as many as CPU cores, at least 2 and at most
8; TEST_WORKERS=N sets the number, and -n 0 runs them in this one process.
Arguments go to pytest, e.g. scripts/run_tests.sh tests/unit -x -k estimator.
GPU tests: .venv/bin/python -m pytest -m gpu tests (on a machine with CUDA).
USAGE
    exit 0
    ;;
esac
cd "$(dirname "$0")/.."
EXTRAS=dev source scripts/setup_env.sh
# Two workers on 2 cores: a test spends much of its time waiting (its ranks' rendezvous, a
# subprocess importing torch), when the other worker's test runs. worksteal: a worker that runs
# out of tests takes the other's last ones (a few tests take a minute, most under a second).
workers="${TEST_WORKERS:-$(nproc 2>/dev/null || echo 2)}"
[ -n "${TEST_WORKERS:-}" ] || workers=$((workers < 2 ? 2 : workers > 8 ? 8 : workers))
exec "$PYTHON" -m pytest -q -m "not gpu" -n "$workers" --dist worksteal "$@"
