"""Prints one table row per run folder from its metrics.jsonl: median tokens/s per GPU after the
first logged step, TFLOP/s, MFU, peak memory and the loss at the last step.

    python scripts/summarize_runs.py outputs/run_a outputs/run_b ...

A folder whose metrics.jsonl is missing, empty or unreadable gets a "failed" row and one line on
stderr naming it; the exit code is then 2 (the other rows are still printed). A half-written last
row (a run killed while writing it) is skipped with a warning.
"""

import argparse
import statistics
import sys
from pathlib import Path

from torchtitan_ablate.components.observability.metrics_file import read_metrics_rows

# Numeric in every row; mfu and memory_max_* are null where the device has no known peak or
# memory statistics (CPU), n/a in the table.
KEYS = ("step", "loss", "tps", "tflops")


class MetricsError(ValueError):
    """A metrics.jsonl that cannot be summarized; the message is the one line the user sees."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.problem = problem


def read_rows(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.is_file():
        raise MetricsError(path, "not found (the run failed before logging, or not a run)")
    try:
        rows = [row for _, row in read_metrics_rows(path, numeric=KEYS)]
    except ValueError as e:
        raise MetricsError(path, str(e)) from None
    if not rows:
        raise MetricsError(path, "empty (the run logged no step)")
    return rows


def summarize(folder: Path) -> dict:
    rows = read_rows(folder)
    steady = rows[1:] or rows
    return {
        "run": folder.name,
        "steps": rows[-1]["step"],
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
        "tps": statistics.median(r["tps"] for r in steady),
        "tflops": statistics.median(r["tflops"] for r in steady),
        "mfu": _median([r.get("mfu") for r in steady]),
        "active_gib": _max([r.get("memory_max_active_gib") for r in rows]),
        "reserved_gib": _max([r.get("memory_max_reserved_gib") for r in rows]),
    }


def _median(values: list) -> float | None:
    numbers = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(numbers) if numbers else None


def _max(values: list) -> float | None:
    numbers = [v for v in values if isinstance(v, (int, float))]
    return max(numbers) if numbers else None


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="run folders (job.dump_folder)")
    args = parser.parse_args(argv)
    print(
        "| run | steps | loss first -> last | tokens/s/GPU | TFLOP/s | MFU % "
        "| active / reserved GiB |"
    )
    print("|---|---|---|---|---|---|---|")
    errors = []
    for path in args.folders:
        try:
            s = summarize(path)
        except MetricsError as e:
            errors.append(str(e))
            print(f"| {path.name} | failed: {e.problem} | | | | | |")
            continue
        print(
            f"| {s['run']} | {s['steps']} | {s['loss_first']:.3f} -> {s['loss_last']:.3f} | "
            f"{s['tps']:,.0f} | {s['tflops']:.1f} | {_num(s['mfu'], '.1f')} | "
            f"{_num(s['active_gib'], '.1f')} / {_num(s['reserved_gib'], '.1f')} |"
        )
    sys.stdout.flush()
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    return 2 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
