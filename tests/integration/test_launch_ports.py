"""run_train.sh on one node without MASTER_PORT: torchrun rendezvouses on a free port, so two
jobs on the same machine run side by side (a fixed 29500 crashed the second one)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "2"]


def test_two_single_node_jobs_at_once_both_succeed(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    env.update(NGPU="2", PYTHON=sys.executable)
    jobs = []
    for name in ("a", "b"):
        cmd = ["./run_train.sh", *SMALL, "--training.steps", "4"]
        cmd += ["--job.dump_folder", str(tmp_path / name)]
        jobs.append(
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outputs = [p.communicate(timeout=300)[0] for p in jobs]
    for p, out in zip(jobs, outputs, strict=True):
        assert p.returncode == 0, out
        assert "loss" in out, out  # it trained (the step line's layout is not this test's business)
