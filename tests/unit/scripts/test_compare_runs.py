"""scripts/compare_runs.py: the multi-GPU correctness check's verdict on loss curves."""

import importlib.util
import json
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("compare_runs", "scripts/compare_runs.py")
compare_runs = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(compare_runs)


def _run(folder: Path, losses: list[float]) -> str:
    folder.mkdir()
    rows = [json.dumps({"step": i + 1, "loss": v}) for i, v in enumerate(losses)]
    (folder / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    return str(folder)


def test_within_and_outside_tolerance(tmp_path, capsys):
    ref = _run(tmp_path / "ref", [10.0, 8.0, 6.0])
    close = _run(tmp_path / "close", [10.0, 8.08, 6.0])  # 1% at step 2
    far = _run(tmp_path / "far", [10.0, 8.0, 6.3])  # 5% at step 3
    assert compare_runs.main([ref, close, "--rtol", "0.02"]) == 0
    assert compare_runs.main([ref, close, far, "--rtol", "0.02"]) == 1
    out = capsys.readouterr().out
    assert "| 5.00e-02 | 3 |" in out and "NO" in out


def test_failed_run_without_metrics_fails(tmp_path, capsys):
    ref = _run(tmp_path / "ref", [10.0])
    assert compare_runs.main([ref, str(tmp_path / "missing")]) == 1
    assert "the run failed" in capsys.readouterr().out


def test_empty_run_metrics_is_a_failed_run(tmp_path, capsys):
    ref = _run(tmp_path / "ref", [10.0])
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    assert compare_runs.main([ref, str(empty)]) == 1
    assert "no logged step: the run failed" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "metrics.jsonl: not found (the reference run)"),
        ("", "metrics.jsonl: empty (the reference logged no step)"),
        ("{garbage\n", "metrics.jsonl: line 1 is not JSON"),
        ('{"step": 1}\n', "metrics.jsonl: line 1 lacks numeric loss"),
    ],
)
def test_unusable_reference_is_one_line(tmp_path, capsys, content, message):
    ref = tmp_path / "ref"
    ref.mkdir()
    if content is not None:
        (ref / "metrics.jsonl").write_text(content)
    run = _run(tmp_path / "run", [10.0])
    assert compare_runs.main([str(ref), run]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {ref / message}")


def test_negative_rtol_is_rejected(tmp_path, capsys):
    ref = _run(tmp_path / "ref", [10.0])
    with pytest.raises(SystemExit) as e:
        compare_runs.main([ref, ref, "--rtol", "-1"])
    assert e.value.code == 2 and "--rtol -1" in capsys.readouterr().err


def test_a_half_written_last_row_is_skipped_with_a_warning(tmp_path, capsys):
    ref = _run(tmp_path / "ref", [10.0, 8.0, 6.0])
    run = _run(tmp_path / "run", [10.0, 8.0])
    with open(Path(run, "metrics.jsonl"), "a") as f:
        f.write('{"step": 3, "loss": 6.')  # the run was killed while writing its last row
    assert compare_runs.main([ref, run]) == 0
    captured = capsys.readouterr()
    assert f"| {run} | 2 | 0.00e+00 |" in captured.out
    assert "line 3 is a half-written last row" in captured.err
