"""A run's metrics.jsonl (written by MetricsLogger) as a file: read back for the scripts that
compare and summarize runs, and tidied when a run starts in a folder that holds one. No torch
import, so the scripts start at once.

A row is written as one JSON object and its newline; a run killed (or out of disk space) while
writing one leaves a last line without its newline. Readers skip such a line with a warning on
stderr; a resumed run removes it before it appends (end_with_a_whole_row), so that its first
row is not glued to it.
"""

import json
import os
import sys
import time
from pathlib import Path


def read_metrics_rows(path: Path, numeric: tuple[str, ...]) -> list[tuple[int, dict]]:
    """(line number, row) for every non-blank line; ValueError naming the line when a row is not
    a JSON object with an integer step and numeric `numeric` fields. A half-written last line
    (no newline, not JSON) is skipped with one warning line on stderr."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read: {e}") from None
    lines = text.splitlines()
    if lines and not text.endswith("\n") and _row(lines[-1]) is None:
        print(
            f"warning: {path}: line {len(lines)} is a half-written last row (the run was "
            f"stopped while writing it): skipped",
            file=sys.stderr,
        )
        lines.pop()
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


def end_with_a_whole_row(path: str) -> str | None:
    """Makes `path` end with a whole row before a run appends to it: a last line without its
    newline is cut off, or given its newline when it is a whole row. Returns what was done, for
    the log; None when the file already ended with a whole row."""
    with open(path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return None
        start = data.rfind(b"\n") + 1
        last = data[start:]
        if _row(last) is not None:
            f.write(b"\n")
            return "its last row lacked its newline (the run was stopped after writing it): added"
        f.truncate(start)
    head = last[:40].decode(errors="replace")
    return (
        f"dropped its half-written last row ({len(last)} bytes, {head!r}...), left by a run "
        "stopped while writing it"
    )


def move_aside(path: str) -> str:
    """Renames metrics.jsonl to metrics.<its time>.jsonl; returns the new path."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(path)))
    old, n = os.path.join(os.path.dirname(path), f"metrics.{stamp}.jsonl"), 1
    while os.path.exists(old):  # two runs ended within the same second
        n += 1
        old = os.path.join(os.path.dirname(path), f"metrics.{stamp}-{n}.jsonl")
    os.replace(path, old)
    return old


def keep_rows_up_to(path: str, step: int) -> int:
    """Rewrites metrics.jsonl without the rows after `step`; returns how many were dropped."""
    with open(path) as f:
        lines = f.read().splitlines()
    kept = [x for x in lines if x.strip() and _row_step(x) <= step]
    dropped = sum(1 for x in lines if x.strip()) - len(kept)
    if dropped:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write("".join(x + "\n" for x in kept))
        os.replace(tmp, path)
    return dropped


def _row(line: str | bytes) -> dict | None:
    """The line as a row (a JSON object), or None."""
    try:
        row = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    return row if isinstance(row, dict) else None


def _row_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 0  # a damaged row is kept: not this file's job to judge it
