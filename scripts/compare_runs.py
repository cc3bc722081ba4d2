"""Loss curves of runs against a reference run, step by step.

    python scripts/compare_runs.py REF_DIR RUN_DIR [RUN_DIR ...] [--rtol 0.02]

Reads each folder's metrics.jsonl and prints, per run, the largest relative loss difference to
the reference over the steps both logged, the step where it occurs, and whether it is within
--rtol. Exit code 1 when any run is outside (or shares no step with the reference).
"""

import argparse
import json
import sys
from pathlib import Path


def losses(folder: str) -> dict[int, float]:
    rows = Path(folder, "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, filter(None, rows))}


def compare(ref: dict[int, float], run: dict[int, float]) -> tuple[float, int | None]:
    """(largest |run - ref| / |ref| over the shared steps, its step); (inf, None) if none."""
    diffs = [(abs(run[s] - ref[s]) / abs(ref[s]), s) for s in sorted(ref.keys() & run.keys())]
    return max(diffs) if diffs else (float("inf"), None)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ref")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--rtol", type=float, default=0.02)
    args = parser.parse_args(argv)
    ref = losses(args.ref)
    print(f"reference {args.ref}: {len(ref)} logged steps, final loss {ref[max(ref)]:.4f}")
    print("| run | shared steps | max rel. loss diff | at step | final loss | within rtol |")
    print("|---|---|---|---|---|---|")
    ok = True
    for folder in args.runs:
        if not Path(folder, "metrics.jsonl").is_file():
            print(f"| {folder} | 0 | - | - | - | NO (no metrics.jsonl: the run failed) |")
            ok = False
            continue
        run = losses(folder)
        worst, step = compare(ref, run)
        within = worst <= args.rtol
        ok &= within
        shared = len(ref.keys() & run.keys())
        print(
            f"| {folder} | {shared} | {worst:.2e} | {step} | {run[max(run)]:.4f} | "
            f"{'yes' if within else 'NO'} |"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
