"""docs/finetuning.md's laptop path (pretrain -> checkpoint -> SFT -> DPO -> export -> generate)
runs as written: the commands between its `<!-- laptop-path -->` markers, each in a shell from
the repository's root, exit 0, and the last one prints a reply.

The root is a folder of links to the checkout's files, so the runs' outputs/laptop lands in the
test's own folder and a user's outputs/laptop is never touched."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.doc_commands import laptop_commands

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "finetuning.md"


def linked_checkout(where: Path) -> Path:
    """`where` holding a link to each top-level entry of the checkout but outputs/."""
    for entry in ROOT.iterdir():
        if entry.name != "outputs":
            (where / entry.name).symlink_to(entry)
    return where


def test_documented_commands_extracted():
    commands = laptop_commands(PAGE.read_text())
    assert [c.split()[0] for c in commands] == ["./run_train.sh"] * 3 + ["python"] * 2
    assert all("\\\n" not in c for c in commands)  # continuations joined


def test_laptop_path_runs_as_documented(tmp_path):
    root = linked_checkout(tmp_path)
    python = Path(sys.executable)
    env = {
        **os.environ,
        "PYTHON": str(python),  # run_train.sh's interpreter: this one, with the dependencies
        "PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}",  # `python` as the docs say
        "PYTHONPATH": str(ROOT),  # scripts/*.py import this checkout's package
    }
    for command in laptop_commands(PAGE.read_text()):
        done = subprocess.run(
            ["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
        last = done
    for step in ("pretrain/checkpoint/step-20", "sft/checkpoint/step-10", "dpo/checkpoint/step-10"):
        assert (root / "outputs" / "laptop" / step).is_dir(), step
    assert sorted(p.name for p in (root / "outputs/laptop/hf").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    assert last.stdout.strip(), f"generate printed no reply:\n{last.stderr[-2000:]}"
