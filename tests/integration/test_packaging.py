"""`pip install .` material: the wheel holds every module of the package and declares the console
commands, and a shipped recipe trains when launched from another directory (its relative paths
are found from the recipe's folder, config/paths.py)."""

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "torchtitan_ablate"


@pytest.mark.slow
def test_wheel_holds_the_package_and_the_commands(tmp_path):
    pytest.importorskip("setuptools")
    # Build from a copy: the build writes build/ and *.egg-info next to its sources.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / PACKAGE, src / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation"]
    r = subprocess.run([*cmd, "-q", "-w", str(tmp_path / "wheel")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / PACKAGE).rglob("*.py")}
    assert modules - names == set(), "modules missing from the wheel"
    assert {n.split("/")[0] for n in names} == {PACKAGE, f"{PACKAGE}-0.1.0.dist-info"}
    entry_points = zipfile.ZipFile(wheel).read(f"{PACKAGE}-0.1.0.dist-info/entry_points.txt")
    for command in ("ttablate-train", "ttablate-estimate", "ttablate-ablate"):
        assert f"{command} = " in entry_points.decode(), command


@pytest.mark.slow
def test_shipped_recipe_trains_from_another_directory(tmp_path):
    config = ROOT / "train_configs" / "debug_model.toml"
    cmd = [sys.executable, "-m", f"{PACKAGE}.train", "--job.config_file", str(config)]
    cmd += ["--training.steps", "2", "--training.seq_len", "32", "--training.local_batch_size", "2"]
    cmd += ["--metrics.log_freq", "1", "--job.dump_folder", "run"]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records] == [1, 2]
    # The recipe's repository-relative tokenizer, found from its folder; recorded absolute.
    written = (tmp_path / "run" / "config.toml").read_text()
    assert f'tokenizer_path = "{ROOT / "assets" / "tokenizer" / "debug.tiktoken"}"' in written
