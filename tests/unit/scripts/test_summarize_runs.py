"""scripts/summarize_runs.py: the table of run folders, and one line per unusable folder."""

import importlib.util
import json

import pytest

SPEC = importlib.util.spec_from_file_location("summarize_runs", "scripts/summarize_runs.py")
summarize_runs = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(summarize_runs)

ROW = {"loss": 5.0, "tps": 100.0, "tflops": 1.0, "mfu": 2.0}
ROW |= {"memory_max_active_gib": 1.0, "memory_max_reserved_gib": 2.0}


def _run(folder, text):
    folder.mkdir()
    if text is not None:
        (folder / "metrics.jsonl").write_text(text)
    return str(folder)


def test_table_row(tmp_path, capsys):
    text = "".join(json.dumps({"step": s, **ROW, "tps": 100.0 * s}) + "\n" for s in (1, 2, 3))
    assert summarize_runs.main([_run(tmp_path / "a", text)]) == 0
    assert "| a | 3 | 5.000 -> 5.000 | 250 | 1.0 | 2.0 | 1.0 / 2.0 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "text, problem",
    [
        (None, "not found"),
        ("", "empty (the run logged no step)"),
        ("{garbage\n", "line 1 is not JSON"),
        ('{"step": 1, "loss": 5.0}\n', "line 1 lacks numeric tps"),
        ("[1]\n", "line 1 is not a JSON object"),
    ],
)
def test_unusable_folder_is_one_line_and_exit_2(tmp_path, capsys, text, problem):
    good = _run(tmp_path / "good", json.dumps({"step": 1, **ROW}) + "\n")
    bad = _run(tmp_path / "bad", text)
    assert summarize_runs.main([good, bad]) == 2
    out, err = capsys.readouterr()
    assert "| good | 1 |" in out and "| bad | failed: " in out  # the other rows still print
    assert len(err.splitlines()) == 1
    assert err.startswith(f"error: {tmp_path / 'bad' / 'metrics.jsonl'}: {problem}")


def test_usage(capsys):
    for argv in ([], ["--bogus"]):
        with pytest.raises(SystemExit) as e:
            summarize_runs.main(argv)
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        summarize_runs.main(["--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out


def test_null_mfu_and_memory_read_n_a(tmp_path, capsys):
    """A CPU run's metrics.jsonl holds null MFU and memory (the console's n/a): n/a here too."""
    row = ROW | {"mfu": None, "memory_max_active_gib": None, "memory_max_reserved_gib": None}
    text = "".join(json.dumps({"step": s, **row}) + "\n" for s in (1, 2))
    assert summarize_runs.main([_run(tmp_path / "cpu", text)]) == 0
    assert "| cpu | 2 | 5.000 -> 5.000 | 100 | 1.0 | n/a | n/a / n/a |" in capsys.readouterr().out
