"""One run per dump folder: `<dump_folder>/run.lock`, held by the run for its whole life.

Two runs in one folder destroy each other: the second one's crash recovery deletes the first
one's save in progress, it resumes from the first one's checkpoint, and both write config.toml
and metrics.jsonl. So a run takes the lock before it reads or writes anything there, and a
second launch stops with one line naming the holder (pid, host, start, command), exit code 2.

The lock is a file created with O_CREAT | O_EXCL, atomic on local disks and on NFSv3 and later
(fcntl/flock locks are not reliable on network file systems), holding the holder's record as
JSON. A lock whose holder is gone is stale and taken over with one log line:
  - holder on this host (same hostname and pid namespace): its pid is not running, or runs
    another program (the process start time differs);
  - holder on another host (a shared file system): the holder refreshes the file's mtime every
    HEARTBEAT_S seconds from a daemon thread; one not refreshed for STALE_AFTER_S seconds is
    stale. The hosts' clocks must agree to well within that (NTP).
Taking over goes through a marker file made with O_EXCL, so of two launches that find the same
stale lock one takes it over and the other then finds it held. A lock of this very process (a
Trainer built earlier here and not run to its end) is taken back silently.
The run removes its lock when it ends, and at interpreter exit. One left behind by a process
that could not (SIGKILL, a lost node) is taken over as above, or deleted by hand once the run
it names is known to be gone: `rm <dump_folder>/run.lock`.
"""

import atexit
import hashlib
import json
import logging
import os
import shlex
import socket
import sys
import threading
import time
import uuid
from typing import Any

from torchtitan_ablate.config.errors import ConfigError

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 600.0  # 20 heartbeats missed: a stalled file server is not a dead run
_TAKEOVER_GIVE_UP_S = 60.0  # a takeover marker this old was left by a launch that died in it
_ATTEMPTS = 20


class DumpFolderLock:
    """A lock this process holds; `release` when the run ends."""

    def __init__(self, path: str, record: dict[str, Any]) -> None:
        self.path, self.record = path, record
        self._stop = threading.Event()
        threading.Thread(target=self._heartbeat, name="dump-folder-lock", daemon=True).start()
        atexit.register(self.release)

    def release(self) -> None:
        """Stops the heartbeat and removes the lock file if it is still this one's."""
        self._stop.set()
        atexit.unregister(self.release)
        if _read(self.path)[0] == self.record:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            held, raw = _read(self.path)
            if held != self.record:
                how = "was removed" if raw is None else f"was taken over by {_holder(held)}"
                logger.error(f"{self.path} {how}: another run may now write into this folder")
                return
            try:
                os.utime(self.path)
            except OSError as e:
                logger.warning(f"cannot refresh {self.path} ({e.strerror}); retrying")


def acquire(folder: str, key: str = "job.dump_folder") -> DumpFolderLock:
    """Takes `<folder>/run.lock` for this process; ConfigError (one line naming the holder and
    what to do) when a live run holds it. `key`: the setting that named the folder."""
    path = os.path.join(folder, LOCK_FILE)
    record = _this_process()
    for _ in range(_ATTEMPTS):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pass
        except OSError as e:
            raise ConfigError(f"{key} = {folder!r}: cannot create {path} ({e.strerror})") from None
        else:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(record))
                f.flush()
                os.fsync(f.fileno())
            return DumpFolderLock(path, record)
        held, raw = _read(path)
        if raw is None:  # released meanwhile
            continue
        why = _stale(held, path)
        if why is None and held is not None:
            raise ConfigError(_held_line(folder, key, path, held))
        if why is not None and _take_over(path, raw):
            if why:
                logger.warning(f"{key} = {folder!r}: took over the lock of {_holder(held)}: {why}")
            continue
        time.sleep(0.1)  # a record still being written, or another launch taking it over
    raise ConfigError(_held_line(folder, key, path, _read(path)[0]))


def check_free(folder: str, key: str = "job.dump_folder") -> None:
    """`acquire`'s ConfigError when a live run holds the folder, taking nothing: a launcher
    checks before its workers start (a stale lock is left for the run to take over)."""
    path = os.path.join(folder, LOCK_FILE)
    held, raw = _read(path)
    if raw is not None and _stale(held, path) is None:
        raise ConfigError(_held_line(folder, key, path, held))


def claim(folder: str) -> DumpFolderLock | None:
    """`acquire` on rank 0 of the process group (None on the others): when the folder is held,
    every rank raises the same ConfigError, so all of them stop together with the one line."""
    import torch.distributed as dist  # here, not above: the ablation runner locks without torch

    lock, held = None, ""
    if dist.get_rank() == 0:
        try:
            lock = acquire(folder)
        except ConfigError as e:
            held = str(e)
    if dist.get_world_size() > 1:
        shared = [held]
        dist.broadcast_object_list(shared, src=0)
        held = shared[0]
    if held:
        raise ConfigError(held)
    return lock


def _this_process() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "pid_namespace": _pid_namespace(),
        "pid_start": _process_start(os.getpid()),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": shlex.join(getattr(sys, "orig_argv", sys.argv)),
        "token": uuid.uuid4().hex,
    }


def _read(path: str) -> tuple[dict[str, Any] | None, bytes | None]:
    """(the record, or None when unreadable or half-written; the raw bytes, None if no file)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None, None
    try:
        held = json.loads(raw)
    except ValueError:
        return None, raw
    if not isinstance(held, dict) or not isinstance(held.get("pid"), int) or held["pid"] <= 0:
        return None, raw
    return held, raw


def _stale(held: dict[str, Any] | None, path: str) -> str | None:
    """Why the lock is stale ("" for this process's own), or None while its holder lives."""
    if held is not None and _same_host(held):
        pid = held["pid"]
        if pid == os.getpid() and held.get("pid_start") == _process_start(pid):
            return ""
        return None if _running(pid, held.get("pid_start")) else f"pid {pid} is not running"
    try:
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return ""
    if age <= STALE_AFTER_S:  # alive elsewhere, or a record still being written
        return None
    what = "its heartbeat stopped" if held is not None else "unreadable, last written"
    return f"{what} {age:.0f} s ago (stale after {STALE_AFTER_S:.0f} s)"


def _take_over(path: str, raw: bytes) -> bool:
    """Removes the stale lock whose content is `raw`, unless another launch is doing so."""
    marker = f"{path}.takeover-{hashlib.sha256(raw).hexdigest()[:16]}"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        try:
            if time.time() - os.stat(marker).st_mtime > _TAKEOVER_GIVE_UP_S:
                os.unlink(marker)
        except FileNotFoundError:
            pass
        return False
    try:
        # Only a holder of this marker removes a lock with this content, so the lock cannot
        # change between this read and the unlink.
        if _read(path)[1] != raw:
            return False
        os.unlink(path)
        return True
    finally:
        os.unlink(marker)


def _held_line(folder: str, key: str, path: str, held: dict[str, Any] | None) -> str:
    if held is None:
        return (
            f"{key} = {folder!r} is being taken by another launch ({path} is unreadable): wait "
            f"for it, or give another {key}; if no run uses this folder, delete {path}"
        )
    heartbeat = ""
    if not _same_host(held):
        age = time.time() - os.stat(path).st_mtime
        heartbeat = f"; heartbeat {age:.0f} s ago, stale after {STALE_AFTER_S:.0f} s"
    return (
        f"{key} = {folder!r} is in use by another run ({_holder(held)}{heartbeat}): wait for it "
        f"to end or stop it, or give this run another {key}; if that run is gone, delete {path}"
    )


def _holder(held: dict[str, Any] | None) -> str:
    if held is None:
        return "an unknown process"
    command = str(held.get("command", "?"))
    command = command if len(command) <= 300 else f"{command[:300]}..."
    return (
        f"pid {held['pid']} on {held.get('host', '?')}, started {held.get('started', '?')}, "
        f"command: {command}"
    )


def _same_host(held: dict[str, Any]) -> bool:
    """Whether the holder's pid means the same process here (another container sharing the
    hostname has another pid namespace)."""
    return held.get("host") == socket.gethostname() and held.get("pid_namespace") == (
        _pid_namespace()
    )


def _running(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    now = _process_start(pid)
    return start is None or now is None or now == start  # a new process under a reused pid


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:  # no /proc (macOS): the hostname alone
        return ""


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks after boot (Linux), to tell a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
