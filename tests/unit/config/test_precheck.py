"""A config the loader rejects is answered before torch is imported: by the config package alone,
by the trainer's and the estimator's entry points, and by run_train.sh before its environment
check, GPU count and torchrun (each of which imports torch, seconds apiece)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ENV = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
TYPO = ["--training.stpes", "3"]
TYPO_LINE = "config error: command line: unknown key 'training.stpes'; keys of [training]:"


def _run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env or ENV, check=False
    )


def _imported(stderr: str) -> list[str]:
    """The modules that `python -X importtime` reports."""
    return [line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if "|" in line]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("import time:")]


@pytest.mark.parametrize(
    "argv",
    [
        TYPO,  # an unknown key
        ["--training.steps", "x"],  # a wrong type
        ["--training.steps", "-3"],  # a value the rules refuse
        ["--job.config_file", "train_configs/debug_model.toml"],  # a config that loads
    ],
)
def test_the_config_is_checked_without_torch(argv):
    code = (
        "import sys\n"
        "from torchtitan_ablate.config.precheck import check_before_torch\n"
        "try:\n"
        f"    check_before_torch({argv!r}, 'prog')\n"
        "finally:\n"
        "    print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    proc = _run([sys.executable, "-c", code])
    assert proc.stdout.strip() == "[]", proc.stdout
    assert proc.returncode == (0 if argv[0] == "--job.config_file" else 2), proc.stderr


@pytest.mark.parametrize(
    "cmd",
    [
        [sys.executable, "-X", "importtime", "-m", "torchtitan_ablate.train", *TYPO],
        [sys.executable, "-X", "importtime", "estimation.py", *TYPO],
    ],
    ids=["train", "estimation"],
)
def test_entry_points_answer_a_config_error_without_importing_torch(cmd):
    proc = _run(cmd)
    assert proc.returncode == 2, proc.stderr
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith(TYPO_LINE), lines
    assert "torch" not in _imported(proc.stderr)


def test_run_train_checks_the_config_before_anything_imports_torch(tmp_path):
    # Every python that run_train.sh starts is logged: a config error must stop it after the
    # config check alone (no environment check, no GPU count, no trainer).
    log = tmp_path / "python.log"
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    env = {**ENV, "PYTHON": str(wrapper)}
    env.pop("NGPU", None)
    proc = _run(["./run_train.sh", *TYPO], env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(TYPO_LINE), lines
    started = log.read_text().splitlines()
    assert len(started) == 1 and started[0].startswith("-m torchtitan_ablate.config.precheck")


def test_run_train_leaves_the_check_to_the_trainer_when_it_cannot_run_light(tmp_path):
    # A python that cannot run the light check (e.g. 3.10 without tomli): the trainer checks.
    wrapper = tmp_path / "python"
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        '[ "$2" = torchtitan_ablate.config.precheck ] && { echo "no tomllib" >&2; exit 1; }\n'
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    proc = _run(["./run_train.sh", *TYPO], {**ENV, "PYTHON": str(wrapper), "NGPU": "1"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(TYPO_LINE), lines
