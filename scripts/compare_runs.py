"""Loss curves of runs against a reference run, step by step.

    python scripts/compare_runs.py REF_DIR RUN_DIR [RUN_DIR ...] [--rtol 0.02]

Reads each folder's metrics.jsonl and prints, per run, the largest relative loss difference to
the reference over the steps both logged, the step where it occurs, and whether it is within
--rtol. Exit code 1 when any run is outside (or shares no step with the reference, or failed:
no metrics.jsonl or no logged step); 2 with one line when a metrics.jsonl is unreadable or the
reference has no logged step. A half-written last row (a run killed while writing it) is skipped
with a warning.
"""

import argparse
import math
import sys
from pathlib import Path

from torchtitan_ablate.components.observability.metrics_file import read_metrics_rows


class MetricsError(ValueError):
    """A metrics.jsonl that cannot be read; the message is the one line the user sees."""


def losses(folder: str) -> dict[int, float]:
    """{step: loss} of folder/metrics.jsonl ({} when the file is empty)."""
    path = Path(folder, "metrics.jsonl")
    try:
        rows = read_metrics_rows(path, numeric=("loss",))
    except ValueError as e:
        raise MetricsError(f"{path}: {e}") from None
    return {row["step"]: float(row["loss"]) for _, row in rows}


def _rel_diff(value: float, ref: float) -> float:
    if ref == 0:
        return 0.0 if value == 0 else float("inf")
    return abs(value - ref) / abs(ref)


def compare(ref: dict[int, float], run: dict[int, float]) -> tuple[float, int | None]:
    """(largest |run - ref| / |ref| over the shared steps, its step); (inf, None) if none."""
    diffs = [(_rel_diff(run[s], ref[s]), s) for s in sorted(ref.keys() & run.keys())]
    return max(diffs) if diffs else (float("inf"), None)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ref")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--rtol", type=float, default=0.02)
    args = parser.parse_args(argv)
    if not (args.rtol >= 0 and math.isfinite(args.rtol)):
        parser.error(f"--rtol {args.rtol:g}: a relative tolerance, 0 or more")
    try:
        return _compare_all(args.ref, args.runs, args.rtol)
    except MetricsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _compare_all(ref_dir: str, runs: list[str], rtol: float) -> int:
    if not Path(ref_dir, "metrics.jsonl").is_file():
        raise MetricsError(f"{Path(ref_dir, 'metrics.jsonl')}: not found (the reference run)")
    ref = losses(ref_dir)
    if not ref:
        raise MetricsError(
            f"{Path(ref_dir, 'metrics.jsonl')}: empty (the reference logged no step)"
        )
    print(f"reference {ref_dir}: {len(ref)} logged steps, final loss {ref[max(ref)]:.4f}")
    print("| run | shared steps | max rel. loss diff | at step | final loss | within rtol |")
    print("|---|---|---|---|---|---|")
    ok = True
    for folder in runs:
        # A run without metrics is a failed run: a NO verdict, not an input error.
        run = losses(folder) if Path(folder, "metrics.jsonl").is_file() else None
        if not run:
            why = "no metrics.jsonl" if run is None else "no logged step"
            print(f"| {folder} | 0 | - | - | - | NO ({why}: the run failed) |")
            ok = False
            continue
        worst, step = compare(ref, run)
        within = worst <= rtol
        ok &= within
        shared = len(ref.keys() & run.keys())
        print(
            f"| {folder} | {shared} | {worst:.2e} | {step} | {run[max(run)]:.4f} | "
            f"{'yes' if within else 'NO'} |"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
