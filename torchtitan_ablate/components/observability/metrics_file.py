"""Reading a run's metrics.jsonl (written by MetricsLogger) back, for the scripts that compare
and summarize runs; no torch import, so they start at once."""

import json
from pathlib import Path


def read_metrics_rows(path: Path, numeric: tuple[str, ...]) -> list[tuple[int, dict]]:
    """(line number, row) for every non-blank line; ValueError naming the line when a row is not
    a JSON object with an integer step and numeric `numeric` fields."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read: {e}") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"line {n} is not JSON: {line[:60]!r}") from None
        if not isinstance(row, dict):
            raise ValueError(f"line {n} is not a JSON object")
        if type(row.get("step")) is not int:
            raise ValueError(f"line {n} lacks an integer step")
        bad = [k for k in numeric if type(row.get(k)) not in (int, float)]
        if bad:
            raise ValueError(f"line {n} lacks numeric {', '.join(bad)}")
        rows.append((n, row))
    return rows
