"""scripts/ holds user tools: each one that is run answers --help with a usage text (the Python
ones without importing torch, whose import takes seconds), the sourced ones say so in their
first line, every script has its line in the README, and none edits sys.path (the package is
installed)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = sorted(p for p in (ROOT / "scripts").iterdir() if p.is_file())
RUN = [p for p in SCRIPTS if p.suffix == ".py" or os.access(p, os.X_OK)]
SOURCED = [p for p in SCRIPTS if p not in RUN]


def test_scripts_found():
    assert {"ablate.py", "run_tests.sh", "check_layouts.sh"} <= {p.name for p in RUN}
    assert {p.name for p in SOURCED} == {"device_setup.sh", "setup_env.sh"}


@pytest.mark.parametrize("path", RUN, ids=[p.name for p in RUN])
def test_help(path):
    cmd = (
        [sys.executable, "-X", "importtime", str(path)]
        if path.suffix == ".py"
        else ["bash", str(path)]
    )
    result = subprocess.run([*cmd, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.lower().startswith("usage:"), result.stdout[:200]
    assert len(result.stdout.splitlines()) >= 3, result.stdout  # a usage text, not a bare line
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()]
    assert "torch" not in imported


@pytest.mark.parametrize("path", SOURCED, ids=[p.name for p in SOURCED])
def test_sourced_scripts_say_so(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("#") and "source" in first.lower(), first


def test_every_script_has_a_readme_line():
    readme = (ROOT / "README.md").read_text()
    assert [p.name for p in SCRIPTS if f"scripts/{p.name}`" not in readme] == []


def test_no_sys_path_manipulation():
    assert [p.name for p in SCRIPTS if "sys.path" in p.read_text()] == []
