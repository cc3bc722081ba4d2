"""scripts/compare_runs.py: the multi-GPU correctness check's verdict on loss curves."""

import importlib.util
import json
from pathlib import Path

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
