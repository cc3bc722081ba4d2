"""An ablation runs the code of the checkout it is launched from, not the one the package was
installed from (pip install -e . of another clone): scripts/ablate.py's own checkout, or for
`ttablate-ablate` the checkout holding the current directory."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from torchtitan_ablate.ablate.checkout import launching_checkout

ROOT = Path(__file__).resolve().parents[3]
MARK = "code of the second clone"
# The console command `ttablate-ablate` (pyproject.toml [project.scripts]).
CONSOLE = "import sys; from torchtitan_ablate.ablate.cli import main; sys.exit(main())"


def _second_clone(tmp_path: Path) -> Path:
    """A copy of this checkout whose package says so when imported."""
    clone = tmp_path / "clone"
    shutil.copytree(
        ROOT / "torchtitan_ablate",
        clone / "torchtitan_ablate",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    (clone / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "ablate.py", clone / "scripts")
    shutil.copy(ROOT / "run_train.sh", clone)
    (clone / "train_configs").mkdir()
    with open(clone / "torchtitan_ablate" / "ablate" / "__init__.py", "a") as f:
        f.write(f"\nprint({MARK!r})\n")
    return clone


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # This checkout stands for the installed one (an editable install puts it on the path).
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TTABLATE_CHECKOUT", None)
    return subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_the_script_runs_its_own_checkouts_code(tmp_path):
    clone = _second_clone(tmp_path)
    proc = _run([sys.executable, str(clone / "scripts" / "ablate.py"), "--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(MARK), proc.stdout[:300]
    assert "usage: python scripts/ablate.py" in proc.stdout


def test_the_console_command_runs_the_checkout_it_is_launched_in(tmp_path):
    clone = _second_clone(tmp_path)
    proc = _run([sys.executable, "-c", CONSOLE, "--help"], clone / "train_configs")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(MARK) and "usage: ttablate-ablate" in proc.stdout
    # Outside any checkout: the installed package, as before.
    proc = _run([sys.executable, "-c", CONSOLE, "--help"], tmp_path)
    assert proc.returncode == 0 and MARK not in proc.stdout


def test_launching_checkout(tmp_path):
    clone = _second_clone(tmp_path)
    script = str(clone / "scripts" / "ablate.py")
    assert launching_checkout(script, tmp_path) == clone
    assert launching_checkout("/usr/bin/ttablate-ablate", clone / "train_configs") == clone
    assert launching_checkout("/usr/bin/ttablate-ablate", tmp_path) is None
