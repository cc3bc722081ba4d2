"""Ctrl-C (SIGINT) in a run of the debug model: the first stops it at the end of the step in
flight, saves that step and exits with 130; a second ends it at once, one line, exit code 130,
the step unsaved and the dump folder unlocked."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "32"]
ARGS += ["--training.local_batch_size", "2", "--training.steps", "3", "--checkpoint.enable"]
ARGS += ["--checkpoint.interval", "1", "--metrics.log_freq", "100"]

# The trainer, with Ctrl-C pressed `times` times during step 2 (argv[1]).
CTRL_C_IN_STEP_2 = """
import os, signal, sys
from torchtitan_ablate import train
from torchtitan_ablate.config import run_main

times = int(sys.argv.pop(1))
real_step = train.Trainer.train_step

def step(self, batches):
    if self.step == 2:
        for _ in range(times):
            os.kill(os.getpid(), signal.SIGINT)
    return real_step(self, batches)

train.Trainer.train_step = step
run_main(train.main, sys.argv[1:])
"""


def _interrupted(tmp_path: Path, times: int) -> tuple[subprocess.CompletedProcess, list[str]]:
    args = [*ARGS, "--job.dump_folder", str(tmp_path)]
    done = subprocess.run([sys.executable, "-c", CTRL_C_IN_STEP_2, str(times), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    errors = [x for x in done.stderr.splitlines() if x.startswith(("error", "Traceback"))]
    return done, errors


@pytest.mark.parametrize("times", [1, 2], ids=["once", "twice"])
def test_ctrl_c_saves_the_step_then_a_second_stops_at_once(tmp_path, times):
    done, errors = _interrupted(tmp_path, times)
    assert done.returncode == 130, done.stderr[-3000:]
    steps = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    if times == 1:
        assert errors == [] and steps == ["step-1", "step-2"]
        assert "stopping at step 2 (Ctrl-C; checkpoint saved)" in done.stderr
    else:
        assert errors == [
            "error: a second Ctrl-C: stopped at once, step 2 not saved (newest checkpoint: step-1)"
        ]
        assert steps == ["step-1"] and not (tmp_path / "run.lock").exists()
