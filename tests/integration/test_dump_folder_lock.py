"""Two launches into one job.dump_folder (a requeued or double-submitted job): the second stops
with one line and exit code 2, alone and under torchrun, and touches nothing, while the first
trains on to its end as if alone; a lock left by a killed run is taken over with one log line."""

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from torchtitan_ablate import train
from torchtitan_ablate.components.checkpoint.dump_lock import LOCK_FILE
from torchtitan_ablate.config import load_config

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "64"]
BASE += ["--training.local_batch_size", "4", "--metrics.log_freq", "1"]
RUN = BASE + ["--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "2"]


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in
            sorted(folder.rglob("*"))}  # fmt: skip


def _under_torchrun(dump: Path) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, NGPU="2", MASTER_PORT=str(port), PYTHON=sys.executable)
    cmd = ["./run_train.sh", *RUN[2:], "--job.dump_folder", str(dump), "--training.seed", "7"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_second_launch_is_refused_and_the_first_trains_on_alone(tmp_path):
    dump = tmp_path / "run"
    train_cmd = [sys.executable, "-m", "torchtitan_ablate.train", *RUN, "--job.dump_folder"]
    log = tmp_path / "first.log"
    with open(log, "w") as f:
        first = subprocess.Popen([*train_cmd, str(dump)], cwd=ROOT, stdout=f, stderr=f)
    try:
        deadline = time.monotonic() + 300
        while not (dump / "checkpoint" / "step-2" / ".metadata").is_file():
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        # Held still mid-run (perhaps inside its next save), so that nothing but the second
        # launches could change the folder while they run.
        first.send_signal(signal.SIGSTOP)
        before = _files(dump)
        alone = subprocess.run([*train_cmd, str(dump), "--training.seed", "7"], cwd=ROOT,
                               capture_output=True, text=True, timeout=600)  # fmt: skip
        torchrun = _under_torchrun(dump)
        after = _files(dump)
    finally:
        first.send_signal(signal.SIGCONT)
    holder = f"pid {first.pid} on {socket.gethostname()}, started "
    command = f"command: {sys.executable} -m torchtitan_ablate.train --job.config_file "
    line = (
        re.escape(f"config error: job.dump_folder = '{dump}' is in use by another run ({holder}")
        + "[^,]+, "
        + re.escape(command)
        + ".*"
        + re.escape(
            "): wait for it to end or stop it, or give this run another job.dump_folder; if "
            f"that run is gone, delete {dump / LOCK_FILE}"
        )
    )
    assert alone.returncode == 2 and re.fullmatch(line, alone.stderr.strip()), alone.stderr
    out = (torchrun.stdout + torchrun.stderr).strip()
    assert torchrun.returncode == 2 and out == alone.stderr.strip(), out
    assert after == before

    assert first.wait(timeout=600) == 0, log.read_text()
    rows = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert load_config(["--job.config_file", str(dump / "config.toml")]).training.seed == 42
    assert sorted(os.listdir(dump / "checkpoint")) == ["step-2", "step-4", "step-6"]
    assert not (dump / LOCK_FILE).exists() and "Traceback" not in log.read_text()


HOLDER = """
import sys, time
from torchtitan_ablate.components.checkpoint.dump_lock import acquire
acquire(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def test_the_lock_of_a_killed_run_is_taken_over(tmp_path, caplog):
    killed = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert killed.stdout.readline() == "held\n"
    killed.send_signal(signal.SIGKILL)  # no chance to remove its lock
    killed.wait()
    with caplog.at_level(logging.WARNING):
        records = train.main(
            load_config(BASE + ["--job.dump_folder", str(tmp_path), "--training.steps", "1"])
        )
    assert [r["step"] for r in records] == [1]
    took = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
    assert len(took) == 1 and took[0].endswith(f": pid {killed.pid} is not running"), took
    assert not (tmp_path / LOCK_FILE).exists()
