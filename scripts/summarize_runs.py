"""Prints one table row per run folder from its metrics.jsonl: median tokens/s per GPU after the
first logged step, TFLOP/s, MFU, peak memory and the loss at the last step.

    python scripts/summarize_runs.py outputs/run_a outputs/run_b ...
"""

import json
import statistics
import sys
from pathlib import Path


def summarize(folder: Path) -> dict:
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x]
    steady = rows[1:] or rows
    return {
        "run": folder.name,
        "steps": rows[-1]["step"],
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
        "tps": statistics.median(r["tps"] for r in steady),
        "tflops": statistics.median(r["tflops"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady),
        "active_gib": max(r["memory_max_active_gib"] for r in rows),
        "reserved_gib": max(r["memory_max_reserved_gib"] for r in rows),
    }


def main(folders: list[str]) -> None:
    print(
        "| run | steps | loss first -> last | tokens/s/GPU | TFLOP/s | MFU % "
        "| active / reserved GiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for f in folders:
        path = Path(f)
        if not (path / "metrics.jsonl").is_file():
            print(f"| {path.name} | failed: no metrics.jsonl | | | | | |")
            continue
        s = summarize(path)
        print(
            f"| {s['run']} | {s['steps']} | {s['loss_first']:.3f} -> {s['loss_last']:.3f} | "
            f"{s['tps']:,.0f} | {s['tflops']:.1f} | {s['mfu']:.1f} | "
            f"{s['active_gib']:.1f} / {s['reserved_gib']:.1f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
