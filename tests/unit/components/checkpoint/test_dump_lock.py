"""components/checkpoint/dump_lock.py: a folder held by a live process is refused with one line
naming it, a lock whose holder is gone (a killed process here, a stopped heartbeat elsewhere)
is taken over with one log line, of launches racing for a stale lock exactly one wins, and under
a process group every rank stops with rank 0's line."""

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

import pytest

from tests.helpers.distributed import run_distributed
from torchtitan_ablate.components.checkpoint import dump_lock
from torchtitan_ablate.components.checkpoint.dump_lock import LOCK_FILE, acquire, check_free, claim
from torchtitan_ablate.config import ConfigError

ROOT = Path(__file__).resolve().parents[4]
# A launch in its own process: takes the lock, says so, holds it until its stdin closes.
HOLDER = """
import sys
from torchtitan_ablate.components.checkpoint.dump_lock import acquire
from torchtitan_ablate.config import ConfigError
try:
    lock = acquire(sys.argv[1])
except ConfigError as e:
    print(e, flush=True)
    sys.exit(2)
print("held", flush=True)
sys.stdin.read()
lock.release()
"""


def _holder(folder: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _held_by_a_killed_process(folder: Path) -> int:
    p = _holder(folder)
    assert p.stdout.readline() == "held\n"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert (folder / LOCK_FILE).is_file()
    return p.pid


def test_a_live_holder_is_named_and_its_lock_left_alone(tmp_path):
    p = _holder(tmp_path)
    assert p.stdout.readline() == "held\n"
    before = (tmp_path / LOCK_FILE).read_bytes()
    try:
        for check in (acquire, check_free):
            with pytest.raises(ConfigError) as e:
                check(str(tmp_path))
            assert re.fullmatch(
                f"job.dump_folder = '{tmp_path}' is in use by another run \\(pid {p.pid} on "
                f"{socket.gethostname()}, started [^,]+, command: \\S+ -c .*\\): wait for it to "
                "end or stop it, or give this run another job.dump_folder; if that run is gone, "
                f"delete {tmp_path / LOCK_FILE}",
                str(e.value),
                flags=re.DOTALL,  # the command holds the holder's newlines
            ), str(e.value)
        assert (tmp_path / LOCK_FILE).read_bytes() == before
        assert sorted(os.listdir(tmp_path)) == [LOCK_FILE]
    finally:
        p.stdin.close()
        p.wait()
    assert not (tmp_path / LOCK_FILE).exists()  # released on the way out


def test_the_lock_of_a_killed_process_is_taken_over(tmp_path, caplog):
    pid = _held_by_a_killed_process(tmp_path)
    check_free(str(tmp_path))  # stale: nothing stops a launcher
    with caplog.at_level(logging.WARNING):
        lock = acquire(str(tmp_path))
    took = [r.getMessage() for r in caplog.records]
    assert len(took) == 1 and re.fullmatch(
        f"job.dump_folder = '{tmp_path}': took over the lock of pid {pid} on .*: pid {pid} is "
        "not running",
        took[0],
        flags=re.DOTALL,
    ), took
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert os.listdir(tmp_path) == []


def test_a_reused_pid_does_not_keep_a_lock(tmp_path):
    """The pid runs, but another program than the holder (its start time differs)."""
    _held_by_a_killed_process(tmp_path)
    record = json.loads((tmp_path / LOCK_FILE).read_text())
    record["pid"] = os.getppid()  # alive, started long before the holder
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))
    acquire(str(tmp_path)).release()


def test_another_hosts_lock_is_stale_when_its_heartbeat_stops(tmp_path, caplog):
    path = tmp_path / LOCK_FILE
    record = {"pid": 4242, "host": "node-b", "started": "then", "command": "train", "token": "t"}
    path.write_text(json.dumps(record))
    with pytest.raises(ConfigError) as e:
        acquire(str(tmp_path))
    held = r"\(pid 4242 on node-b, started then, command: train; heartbeat [01] s ago, stale after"
    assert re.search(held + r" 600 s\): wait for it", str(e.value)), str(e.value)
    old = time.time() - dump_lock.STALE_AFTER_S - 60
    os.utime(path, (old, old))
    with caplog.at_level(logging.WARNING):
        acquire(str(tmp_path)).release()
    assert "pid 4242 on node-b" in caplog.text and "its heartbeat stopped 660 s ago" in caplog.text


def test_the_holder_refreshes_its_heartbeat_and_notices_a_takeover(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(dump_lock, "HEARTBEAT_S", 0.05)
    lock = acquire(str(tmp_path))
    path = tmp_path / LOCK_FILE
    os.utime(path, (0, 0))
    deadline = time.time() + 30
    while path.stat().st_mtime == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert path.stat().st_mtime > time.time() - 30
    other = tmp_path / "other"  # in place at once: the heartbeat never reads it half-written
    other.write_text(json.dumps({"pid": 4242, "host": "node-b", "command": "train"}))
    os.replace(other, path)
    with caplog.at_level(logging.ERROR):
        while "taken over" not in caplog.text and time.time() < deadline:
            time.sleep(0.05)
    assert f"{path} was taken over by pid 4242 on node-b" in caplog.text
    lock.release()
    assert path.is_file()  # another's lock now: left alone


def test_this_process_takes_its_own_lock_back(tmp_path):
    first = acquire(str(tmp_path))
    second = acquire(str(tmp_path))
    first.release()  # no longer its lock: leaves the second's file alone
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == second.record
    second.release()
    assert os.listdir(tmp_path) == []


def test_of_launches_racing_for_a_stale_lock_one_wins(tmp_path):
    _held_by_a_killed_process(tmp_path)
    launches = [_holder(tmp_path) for _ in range(4)]
    try:
        deadline = time.time() + 120
        while sum(p.poll() is not None for p in launches) < 3 and time.time() < deadline:
            time.sleep(0.1)
        (winner,) = [p for p in launches if p.poll() is None]
        assert winner.stdout.readline() == "held\n"
        for p in launches:
            if p is not winner:
                assert p.returncode == 2
                assert f"is in use by another run (pid {winner.pid} on" in p.stdout.read()
    finally:
        for p in launches:
            p.stdin.close()
            p.wait()
    assert os.listdir(tmp_path) == []  # no lock and no takeover marker left


def _claim_on_every_rank(folder: str) -> str:
    try:
        lock = claim(folder)
    except ConfigError as e:
        return f"refused: {e}"
    held = lock is not None
    if lock is not None:
        lock.release()
    return f"held: {held}"


@pytest.mark.slow
def test_every_rank_stops_with_rank_0s_line(tmp_path):
    assert run_distributed(_claim_on_every_rank, 2, str(tmp_path)) == ["held: True", "held: False"]
    lock = acquire(str(tmp_path))  # this test's process: another run for the ranks
    try:
        lines = run_distributed(_claim_on_every_rank, 2, str(tmp_path))
    finally:
        lock.release()
    assert lines[0] == lines[1] and lines[0].startswith(
        f"refused: job.dump_folder = '{tmp_path}' is in use by another run (pid {os.getpid()} "
    )
