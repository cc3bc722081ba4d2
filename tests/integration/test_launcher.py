"""run_train.sh with NGPU=2 (torchrun through torchtitan_ablate.launch) on CPU: SIGTERM reaches
the workers (and their loader workers survive it) and they save before exiting; an error on the
rank whose output LOG_RANK hides reaches the terminal as its one line; a config error is one
line and exit code 2, as without torchrun; a run's console holds no torchrun banner and no
library warning, and our own warnings still show."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "2"]


def _launch(tmp_path: Path, args: list[str], env: dict | None = None, **popen) -> subprocess.Popen:
    """env: variables set, or (None) unset, on top of this process's."""
    with socket.socket() as s:  # a free rendezvous port: tests may overlap other runs
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, NGPU="2", MASTER_PORT=str(port), PYTHON=sys.executable, **(env or {}))
    env = {k: v for k, v in env.items() if v is not None}
    cmd = ["./run_train.sh", *SMALL, "--job.dump_folder", str(tmp_path / "run"), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, **popen)


def _output(tmp_path: Path, args: list[str], **env: str | None) -> tuple[int, str]:
    p = _launch(tmp_path, args, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = p.communicate(timeout=300)
    return p.returncode, out


def test_sigterm_reaches_the_workers_and_they_save_before_exiting(tmp_path):
    log = tmp_path / "out.log"
    args = ["--training.steps", "100000", "--metrics.log_freq", "100000"]
    args += ["--checkpoint.enable", "--checkpoint.interval", "100000"]
    args += ["--training.num_workers", "1"]  # torchrun signals the loader workers too
    with open(log, "w") as f:
        p = _launch(tmp_path, args, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while "step     1/" not in log.read_text() and time.monotonic() < deadline:
            assert p.poll() is None, log.read_text()
            time.sleep(0.5)
        time.sleep(1)  # a few steps into the run, not on a log step
        p.send_signal(signal.SIGTERM)  # what a scheduler sends to the launcher
        code = p.wait(timeout=120)
    out = log.read_text()
    assert code == 128 + signal.SIGTERM, out
    stops = [x for x in out.splitlines() if "stopping at step" in x]
    assert len(stops) == 1 and stops[0].endswith("(SIGTERM; checkpoint saved)"), out
    step = int(stops[0].split("stopping at step ")[1].split()[0])
    assert (tmp_path / "run" / "checkpoint" / f"step-{step}" / ".metadata").is_file()
    assert "Traceback" not in out and "killed by signal" not in out, out


def test_an_error_on_a_hidden_rank_reaches_the_terminal(tmp_path):
    # Rank 1 reads documents 1, 3, ...: here only an empty one, a data error on rank 1 alone.
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a first document", ""]))
    code, out = _output(tmp_path, ["--training.steps", "2", "--training.dataset_path", str(data)])
    assert code == 2, out
    errors = [x for x in out.splitlines() if x.startswith("config error:")]
    assert len(errors) == 1 and errors[0].endswith("(rank 1)"), out
    assert "shard 1 of 2 (data-parallel ranks x training.num_workers) got no non-empty" in out
    assert "Traceback" not in out, out


def test_a_config_error_is_one_line_and_exit_code_2(tmp_path):
    code, out = _output(tmp_path, ["--training.steps", "0"])
    assert (code, out.splitlines()) == (
        2,
        ["config error: training.steps = 0: must be >= 1"],
    )


def test_the_console_says_only_what_matters(tmp_path):
    # Both ranks shown, and the paths that used to warn: the HF export's one-process DCP read.
    # Our own warning (warmup 5 > 1 step) must still show.
    args = ["--training.steps", "1", "--checkpoint.enable", "--checkpoint.last_save_in_hf"]
    quiet_shell = {"OMP_NUM_THREADS": None, "PYTHONWARNINGS": None}  # as on a newcomer's shell
    code, out = _output(tmp_path, [*args, "true"], LOG_RANK="0,1", **quiet_shell)
    assert code == 0, out
    assert "OMP_NUM_THREADS" not in out and "*****" not in out, out  # torchrun's banner
    assert not re.search(r"\w*Warning: ", out), out  # Python warnings: file:line: UserWarning:
    assert "warmup shortened to 1 steps" in out, out
    assert "run ended: final loss" in out, out
