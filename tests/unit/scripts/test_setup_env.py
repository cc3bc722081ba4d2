"""scripts/setup_env.sh picks an interpreter without installing anything when one works: an
activated virtual environment that imports the dependencies is used as it is."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _fake_venv(tmp_path: Path, python: str) -> Path:
    """A virtual environment's layout whose bin/python runs `python` (a wrapper, not a
    symlink: a symlinked venv python would lose its site-packages)."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    wrapper = bin_dir / "python"
    wrapper.write_text(f'#!/usr/bin/env bash\nexec {python} "$@"\n')
    wrapper.chmod(0o755)
    return tmp_path / "venv"


def _chosen_python(venv: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "FORCE_VENV", "EXTRAS")}
    env["VIRTUAL_ENV"] = str(venv)
    result = subprocess.run(
        ["bash", "-c", 'source scripts/setup_env.sh >/dev/null && echo "$PYTHON"'],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "setting up" not in result.stderr, result.stderr  # nothing installed
    return result.stdout.strip()


def test_an_activated_venv_that_works_is_used_as_it_is(tmp_path):
    venv = _fake_venv(tmp_path, sys.executable)
    assert _chosen_python(venv) == str(venv / "bin" / "python")


def test_an_activated_venv_without_the_dependencies_is_passed_over(tmp_path):
    if not (ROOT / ".venv" / "bin" / "python").exists():
        return  # the fallback would set up .venv: not a unit test's business
    venv = _fake_venv(tmp_path, "false")
    assert _chosen_python(venv) == str(ROOT / ".venv" / "bin" / "python")


def test_the_venv_import_check_runs_once_per_install(tmp_path):
    # A copy of the script in a fake checkout whose .venv python logs each time it runs.
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup_env.sh").write_text((ROOT / "scripts/setup_env.sh").read_text())
    (tmp_path / "pyproject.toml").write_text("")
    log = tmp_path / "calls"
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/usr/bin/env bash\necho x >> {log}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV", "EXTRAS")}

    def source() -> int:
        cmd = ["bash", "-c", 'source scripts/setup_env.sh && echo "$PYTHON"']
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.strip() == str(python), r.stderr
        return len(log.read_text().splitlines()) if log.exists() else 0

    assert source() == 1  # checked (imports torch), then stamped
    assert source() == 1  # the stamp stands for the check
    os.utime(tmp_path / "pyproject.toml", (2e9, 2e9))  # edited after the stamp: checked again
    assert source() == 2
