"""The temporary folder an export writes before renaming it to its output folder, the cleanup of
the ones a killed export left behind, and file modes that follow the umask.

An export (scripts/convert_checkpoint.py) writes `.<out>.<host>.<pid>.<random>.tmp` beside its
output folder and renames it to the output when done; a failed export removes it. One ended by
SIGKILL (the OOM killer, a lost node) cannot, and leaves a hidden model-sized folder. The next
export into the same parent folder removes those of exports that are gone, with a log line:
written on this host by a pid that no longer runs. A folder of another host (a shared file
system) is left alone, as whether its export still runs cannot be told from here.

safetensors writes its files with mode 0600; `as_umask_allows` gives them the mode any new file
gets (0644 under the usual umask 022), so that others who may read the folder can read them.
"""

import logging
import os
import re
import secrets
import shutil
import socket
from pathlib import Path

logger = logging.getLogger("torchtitan_ablate")

_TEMP = re.compile(r"^\.(?P<out>.+)\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def temp_folder(out: Path) -> Path:
    """The name of this export's temporary folder for `out` (not created)."""
    return out.parent / f".{out.name}.{_host()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale(parent: Path) -> list[Path]:
    """Removes the temporary folders in `parent` of exports on this host that no longer run;
    returns them."""
    removed = []
    for path in sorted(parent.iterdir()) if parent.is_dir() else []:
        m = _TEMP.match(path.name)
        if m is None or m["host"] != _host() or not path.is_dir() or _running(int(m["pid"])):
            continue
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        shutil.rmtree(path, ignore_errors=True)
        logger.warning(
            f"removed {path} ({size / 2**20:,.1f} MiB): the temporary folder of an export of "
            f"{m['out']} (pid {m['pid']}) that was killed before it could clean up"
        )
        removed.append(path)
    return removed


def _umask() -> int:
    try:  # Linux: read without changing it (os.umask sets it, for every thread)
        with open("/proc/self/status") as f:
            return next(int(x.split()[1], 8) for x in f if x.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def as_umask_allows(path: Path | str) -> None:
    """Gives the file at `path` the mode of a new file (0666 less the umask)."""
    os.chmod(path, 0o666 & ~_umask())
