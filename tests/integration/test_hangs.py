"""Hangs end: a step that outlives the SIGTERM grace ends the process with one line (exit code
143, the older checkpoints kept, the dump folder unlocked)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "32"]
ARGS += ["--training.local_batch_size", "2", "--training.steps", "5", "--checkpoint.enable"]
ARGS += ["--checkpoint.interval", "1"]

# The trainer, with step 2 signalled and then stuck for an hour (as a hung data read would be).
STUCK_AT_STEP_2 = """
import os, signal, sys, time
from torchtitan_ablate import train
from torchtitan_ablate.config import run_main

real_step = train.Trainer.train_step

def stuck_step(self, batches):
    if self.step == 2:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(3600)
    return real_step(self, batches)

train.Trainer.train_step = stuck_step
run_main(train.main, sys.argv[1:])
"""


def test_a_step_that_outlives_the_sigterm_grace_is_one_line_and_exit_143(tmp_path):
    args = [*ARGS, "--job.dump_folder", str(tmp_path), "--training.sigterm_grace_seconds", "1"]
    done = subprocess.run([sys.executable, "-c", STUCK_AT_STEP_2, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    errors = [x for x in done.stderr.splitlines() if x.startswith(("error", "Traceback"))]
    assert done.returncode == 143, done.stderr[-3000:]
    assert errors == [
        "error: step 2 did not end within training.sigterm_grace_seconds = 1 s of SIGTERM (a "
        "hung data read, template or collective): stopped without saving it (newest "
        "checkpoint: step-1)"
    ]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1"]
    assert not (tmp_path / "run.lock").exists()
