"""scripts/make_debug_assets.py: the shipped assets are current; the larger-corpus option."""

import importlib.util
import json
import subprocess
import sys

import pytest

SCRIPT = "scripts/make_debug_assets.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)


def test_shipped_assets_are_current():
    result = _run("--check")
    assert result.returncode == 0, result.stderr


def test_larger_corpus_is_new_documents(tmp_path):
    out = tmp_path / "big.jsonl"
    assert _run("--corpus-docs", "700", "--corpus-out", str(out), "--seed", "7").returncode == 0
    docs = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    shipped = {json.loads(line)["text"] for line in open("assets/data/debug_corpus.jsonl")}
    assert len(docs) == 700 and len(set(docs)) > 690
    assert len(shipped.intersection(docs)) < 10  # another seed: other documents


def test_corpus_options_go_together(tmp_path):
    result = _run("--corpus-docs", "5")
    assert result.returncode == 2 and "go together" in result.stderr
    result = _run("--corpus-docs", "0", "--corpus-out", str(tmp_path / "x.jsonl"))
    assert result.returncode == 2 and "positive" in result.stderr
    result = _run("--seed", "7")  # would otherwise rewrite the shipped assets, seed ignored
    assert result.returncode == 2 and "--corpus-docs only" in result.stderr


def test_unwritable_corpus_out_is_one_line(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("make_debug_assets", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for bad in ("/proc/nope/c.jsonl", str(tmp_path)):  # no such folder; a folder, not a file
        with pytest.raises(SystemExit) as e:
            script.main(["--corpus-docs", "2", "--corpus-out", bad])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"--corpus-out {bad}:")
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind
