"""How long a user waits for the first answer: a config typo and --help, per entry point.

    python scripts/startup_times.py [--repeat 3] [--checkout DIR]

Runs each command --repeat times in the checkout (default: this one; another clone to compare
against, e.g. an older commit unpacked with `git archive`) and prints the median wall time in
seconds, with `import torch` alone for scale. The target is under 1 s for every row but that
one, on a quiet machine: the config and the options are checked before torch is imported.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TYPO = ["--training.stpes", "3"]  # an unknown key: exit code 2 with one line
SCRIPTS = ["bench", "bench_attention", "convert_checkpoint", "generate", "validate_estimator"]


def commands(python: str) -> dict[str, list[str]]:
    cmds = {
        "./run_train.sh (config typo)": ["./run_train.sh", *TYPO],
        "python -m torchtitan_ablate.train (config typo)": [
            python, "-m", "torchtitan_ablate.train", *TYPO
        ],
        "python estimation.py (config typo)": [python, "estimation.py", *TYPO],
        "./run_train.sh --help": ["./run_train.sh", "--help"],
    }  # fmt: skip
    for name in SCRIPTS:
        cmds[f"python scripts/{name}.py --help"] = [python, f"scripts/{name}.py", "--help"]
    cmds["python -c 'import torch' (for scale)"] = [python, "-c", "import torch"]
    return cmds


def timed(cmd: list[str], checkout: Path, env: dict[str, str]) -> tuple[float, int]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, check=False)
    return time.perf_counter() - start, proc.returncode


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeat", type=int, default=3, help="runs per command (the median counts)")
    p.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parents[1])
    a = p.parse_args(argv)
    if a.repeat < 1:
        p.error(f"--repeat {a.repeat}: at least 1")
    checkout = a.checkout.resolve()
    # The checkout's own package, as run_train.sh sets it; PYTHON: run_train.sh's interpreter.
    env = dict(os.environ, PYTHONPATH=str(checkout), PYTHON=sys.executable)
    print(f"checkout {checkout}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    print("| command | median s | exit code |")
    print("|---|---|---|")
    for label, cmd in commands(sys.executable).items():
        runs = [timed(cmd, checkout, env) for _ in range(a.repeat)]
        median = statistics.median(s for s, _ in runs)
        print(f"| {label} | {median:.2f} | {runs[-1][1]} |", flush=True)


if __name__ == "__main__":
    main()
