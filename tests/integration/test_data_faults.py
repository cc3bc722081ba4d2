"""Faults around a run's data and its logs, on the debug model in one process
(docs/reliability.md): a resume with another loader layout, a half-written metrics row, a
parquet file damaged mid-run."""

import json
import logging
import re
import subprocess
import sys

import pytest

from tests.helpers.data import damage_row_group
from tests.helpers.training import run, run_cli
from torchtitan_ablate import train

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


def test_a_resume_that_turns_the_shuffle_buffer_off_continues(tmp_path, caplog):
    run(tmp_path, *FIRST, "--training.shuffle_buffer", "16")
    with caplog.at_level(logging.INFO, logger="torchtitan_ablate"):
        rest = run(tmp_path, *STEPS, "--training.shuffle_buffer", "0")
    assert [r["step"] for r in rest] == [3]
    assert "data: training.shuffle_buffer 16 -> 0: the 16 documents of the checkpoint's" in (
        caplog.text
    )


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


def test_a_parquet_file_damaged_mid_run_is_one_line_and_keeps_the_checkpoints(
    tmp_path, monkeypatch
):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [json.loads(x)["text"] for x in open("assets/data/debug_corpus.jsonl")]
    data = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": texts}), data, row_group_size=10)
    real_step = train.Trainer.train_step

    def step_then_damage(self, batches):
        if self.step == 3:  # the footer stays intact: only reading the pages fails
            for group in range(2, 65):
                damage_row_group(data, group)
        return real_step(self, batches)

    monkeypatch.setattr(train.Trainer, "train_step", step_then_damage)
    args = ["--training.steps", "10", "--checkpoint.enable", "--checkpoint.interval", "2"]
    args += ["--training.dataset_path", str(data)]
    code, lines = run_cli(tmp_path / "run", *args)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"config error: training.dataset_path: {data}: row group 2 ")
    assert "(rows 20-29) cannot be read" in lines[0]
    names = [p.name for p in (tmp_path / "run" / "checkpoint").iterdir()]
    assert names and all(re.fullmatch(r"step-\d+", n) for n in names), names  # no step-N.tmp
    monkeypatch.undo()
    pq.write_table(pa.table({"text": texts}), data, row_group_size=10)  # the file written again
    newest = max(int(n[5:]) for n in names)
    assert [r["step"] for r in run(tmp_path / "run", *args)][0] == newest + 1
