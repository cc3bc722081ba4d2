"""Faults around a run's data and its logs, on the debug model in one process
(docs/reliability.md): a resume with another loader layout, a half-written metrics row."""

import json
import logging
import subprocess
import sys

from tests.helpers.training import run, run_cli

STEPS = ["--training.steps", "3", "--checkpoint.enable"]
FIRST = [*STEPS, "--training.exit_at_step", "2"]


def test_a_resume_with_another_num_workers_continues_exactly_or_is_one_line(tmp_path):
    assert run_cli(tmp_path / "docs", *FIRST)[0] == 0
    code, lines = run_cli(tmp_path / "docs", *STEPS, "--training.num_workers", "2")
    assert code == 2 and len(lines) == 1, lines
    assert (
        lines[0].startswith("config error: checkpoint ")
        and "step-2: training.num_workers" in lines[0]
    )
    assert lines[0].endswith("resume with --training.num_workers 0 (0 and 1 are interchangeable)")
    rows = ["--training.data_sharding", "rows"]  # every worker reads the whole stream
    full = run(tmp_path / "full", *STEPS, *rows)
    run(tmp_path / "rows", *FIRST, *rows)
    rest = run(tmp_path / "rows", *STEPS, *rows, "--training.num_workers", "2")
    assert [r["loss"] for r in rest] == [r["loss"] for r in full[2:]]


def test_a_half_written_metrics_row_is_dropped_on_resume(tmp_path, caplog):
    run(tmp_path, *FIRST)
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "a") as f:  # killed (or out of disk space) while writing step 3's row
        f.write('{"step": 3, "loss": 6.1, "grad_')
    with caplog.at_level(logging.WARNING, logger="torchtitan_ablate"):
        run(tmp_path, *STEPS)
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "dropped its half-written last row (31 bytes" in caplog.text
    script = [sys.executable, "scripts/compare_runs.py", str(tmp_path), str(tmp_path)]
    assert subprocess.run(script, capture_output=True).returncode == 0
