"""--help of the entry points: every section and key, one section on request, no torch import."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_ablate.config.help import ENVIRONMENT, exit_if_help, help_text

ROOT = Path(__file__).resolve().parents[3]


def test_help_lists_every_section_with_defaults_and_meaning():
    text = help_text("prog")
    for section in ("[job]", "[training]", "[parallelism]", "[memory_estimation]"):
        assert section in text
    assert "  --training.local_batch_size  (an integer, default 8)" in text.splitlines()
    assert "--parallelism.expert_parallel_degree" in text


def test_help_of_one_section_and_a_bad_section(capsys):
    with pytest.raises(SystemExit) as exit_:
        exit_if_help(["--help", "lora"], "prog")
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "[lora]" in out and "[training]" not in out
    with pytest.raises(SystemExit) as exit_:
        exit_if_help(["-h", "nosuch"], "prog")
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("config error: no section [nosuch]")


@pytest.mark.parametrize(
    "cmd",
    [
        [sys.executable, "-X", "importtime", "-m", "torchtitan_ablate.train", "--help"],
        ["./run_train.sh", "--help", "training"],
        [sys.executable, "-X", "importtime", "estimation.py", "-h"],
    ],
)
def test_entry_points_answer_help_without_importing_torch(cmd):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "[training]" in proc.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()]
    assert "torch" not in imported


def test_the_launchers_help_lists_every_environment_variable_it_reads():
    scripts = (ROOT / "run_train.sh").read_text() + (ROOT / "scripts/setup_env.sh").read_text()
    read = set(re.findall(r"\$\{([A-Z][A-Z_]*)", scripts)) - {"PYTHONPATH", "BASH_SOURCE"}
    assert {"NGPU", "CONFIG_FILE", "LOG_RANK", "MASTER_PORT", "PYTHON"} <= read
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    shown = subprocess.run(["./run_train.sh", "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env=env, check=True).stdout  # fmt: skip
    listed = set(re.findall(r"\b[A-Z][A-Z_]{3,}\b", shown.split("Environment variables")[1]))
    assert read <= listed, read - listed
    assert "[training]" in shown  # the keys, then the environment
    assert help_text("prog", "environment") == ENVIRONMENT
    assert "Environment variables" not in help_text("python estimation.py", launcher=False)
    assert "Environment variables" not in help_text("prog", "training")
