"""metrics.jsonl as a file: a half-written last row (a run killed or out of disk space while
writing it) is skipped by readers with a warning and removed before a resumed run appends."""

import json

import pytest

from torchtitan_ablate.components.observability.metrics_file import (
    end_with_a_whole_row,
    read_metrics_rows,
)

ROWS = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2))


def test_readers_skip_a_half_written_last_row_with_a_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(ROWS + '{"step": 3, "lo')
    assert [row["step"] for _, row in read_metrics_rows(path, ("loss",))] == [1, 2]
    err = capsys.readouterr().err
    assert (
        err == f"warning: {path}: line 3 is a half-written last row (the run was stopped "
        "while writing it): skipped\n"
    )
    path.write_text(ROWS + '{"step": 3, "loss": 0.3}')  # whole, only its newline missing
    assert [row["step"] for _, row in read_metrics_rows(path, ("loss",))] == [1, 2, 3]
    path.write_text('{"step": 1, "lo\n' + ROWS)  # damage inside the file is still an error
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        read_metrics_rows(path, ("loss",))


def test_a_resumed_run_appends_after_a_whole_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(ROWS + '{"step": 3, "lo')
    assert "dropped its half-written last row (15 bytes" in end_with_a_whole_row(str(path))
    assert path.read_text() == ROWS
    path.write_text(ROWS + '{"step": 3, "loss": 0.3}')
    assert "lacked its newline" in end_with_a_whole_row(str(path))
    assert path.read_text().endswith("0.3}\n")
    assert end_with_a_whole_row(str(path)) is None and path.read_text().count("\n") == 3
    path.write_text("garbage")  # a file of one half-written row: nothing left
    assert end_with_a_whole_row(str(path)) and path.read_text() == ""
