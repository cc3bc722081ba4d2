"""ConfigError, and the one line a failed run prints instead of a traceback when the user can act
on the failure.

    config error: ...  a ConfigError: a bad key, value, file or data line (exit code 2)
    error: interrupted (Ctrl-C) outside the training steps, e.g. during the model build (exit
                       code 130; within them, components/preemption.py stops and saves)
    error: ...         a full disk or quota anywhere in the exception's chain, or any other
                       OSError on a path under job.dump_folder (permissions, a read-only file
                       system, an I/O error: exit code 2); a collective that timed out or lost
                       its peer, i.e. another rank failed, stalled or was stopped (exit code 1)
Anything else keeps its traceback (a bug: the traceback is the report) and exit code 1.
`report` writes the line to stderr and, under torchrun, to the rank's error file
(TORCHELASTIC_ERROR_FILE), where the launcher (torchtitan_ablate/launch.py) reads it back: the line
of a rank whose output LOG_RANK hides still reaches the terminal.
"""

import errno
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator

# Messages of gloo and NCCL when a collective gives up on its peers.
_PEER_LOST = (
    "timed out",
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "communicator was aborted",
)
# torch.save's zip writer reports a short write (a full disk) as a position mismatch.
_SHORT_WRITE = ("unexpected pos", "file write failed")


class ConfigError(ValueError):
    """A bad config key, value or file; the message is the one line the user sees.

    One raised in a data-loader worker reaches the main process rebuilt from one string,
    "Caught <class> in DataLoader worker process N.\\nOriginal Traceback ...<class>: <message>";
    only the message is kept, so the user still sees one line."""

    def __init__(self, *args: object) -> None:
        name = type(self).__name__
        if args and isinstance(args[0], str) and args[0].startswith(f"Caught {name} in DataLoader"):
            args = (args[0].rstrip().rsplit(f"{name}: ", 1)[-1], *args[1:])
        super().__init__(*args)


def _chain(e: BaseException, seen: set[int] | None = None) -> Iterator[BaseException]:
    """e, its causes and contexts, and the per-rank failures that DCP's CheckpointException
    gathers (it keeps them in `failures`, not in the chain)."""
    seen = set() if seen is None else seen
    if e is None or id(e) in seen:
        return
    seen.add(id(e))
    yield e
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for value in failures.values():
            inner = value[0] if isinstance(value, tuple) else value
            if isinstance(inner, BaseException):
                yield from _chain(inner, seen)
    yield from _chain(e.__cause__, seen)
    yield from _chain(e.__context__, seen)


def _free(folder: str) -> str:
    while folder and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    try:
        return f"{shutil.disk_usage(folder or '.').free / 2**20:,.0f} MiB free"
    except OSError:
        return "free space unknown"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _runtime_error_saying(chain: list[BaseException], needles: tuple[str, ...]) -> str | None:
    """The first line of the first RuntimeError in the chain whose message holds a needle."""
    for x in chain:
        if isinstance(x, RuntimeError) and any(n in _first_line(x).lower() for n in needles):
            return _first_line(x)
    return None


def _inside(path: object, folder: str) -> bool:
    if not isinstance(path, (str, bytes)):
        return False
    path, folder = os.path.realpath(os.fsdecode(path)), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _output_error(chain: list[BaseException], dump_folder: str) -> str | None:
    """The line for the first OSError on a path under the dump folder, None if there is none."""
    for x in chain:
        if not isinstance(x, OSError) or x.errno is None:
            continue
        path = next((p for p in (x.filename, x.filename2) if _inside(p, dump_folder)), None)
        if path is None:
            continue
        name = errno.errorcode.get(x.errno, f"errno {x.errno}")
        where = f"job.dump_folder = {dump_folder!r}"
        if x.errno in (errno.EACCES, errno.EPERM):
            fix = f"this run may not write there: fix the permissions under {where}"
        elif x.errno == errno.EROFS:
            fix = f"the file system under {where} is read-only: remount it read-write"
        else:
            fix = f"check the disk and file system under {where}"
        what = f"{name} ({x.strerror}) on {os.fsdecode(path)}"
        return f"error: {what}: {fix}, or point job.dump_folder elsewhere"
    return None


def one_line(e: BaseException, dump_folder: str | None = None) -> tuple[str, int] | None:
    """(line, exit code) for a failure the user can act on, None for anything else.
    dump_folder: the run's, None before the config is read."""
    if isinstance(e, ConfigError):
        return f"config error: {e}", 2
    if isinstance(e, KeyboardInterrupt):  # in the training loop, Ctrl-C stops and saves instead
        return "error: interrupted (Ctrl-C) outside the training steps: nothing saved", 130
    if isinstance(e, SystemExit):
        return None
    chain = list(_chain(e))
    folder = dump_folder or "."
    for x in chain:
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            where = x.filename or folder
            return (
                f"error: no space left on device ({x.strerror}) writing {where} ({_free(where)} "
                f"there): free some space or point job.dump_folder at another disk"
            ), 2
    output = None if dump_folder is None else _output_error(chain, dump_folder)
    if output is not None:
        return output, 2
    short_write = _runtime_error_saying(chain, _SHORT_WRITE)
    if short_write is not None:
        return (
            f"error: a file write failed ({short_write}); the disk under job.dump_folder = "
            f"{folder!r} is probably full ({_free(folder)})"
        ), 2
    lost = _runtime_error_saying(chain, _PEER_LOST)
    if lost is not None and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # gloo: "[.../pair.cc:553] Connection closed by peer [addr]:port. This is typically ..."
        what = re.sub(r"^\[[^\]]*\]\s*", "", lost).split(". ")[0]
        return (
            f"error: rank {os.environ.get('RANK', '?')}: a collective failed ({what}): another "
            "rank failed, stalled (comm.train_timeout_seconds) or was stopped; its error says why"
        ), 1
    return None


def report(line: str, exit_code: int | None = None) -> None:
    """Prints the line on stderr and leaves it, with the exit code the process is about to
    return, for torchrun's launcher (see the module doc): torchrun may kill the process on its
    way out, which changes the code it sees."""
    print(line, file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        # "message" and "timestamp" are what torchrun's ProcessFailure reads.
        data = {"message": line, "timestamp": int(time.time()), "time": time.time()}
        if exit_code is not None:
            data["exit_code"] = exit_code
        try:
            with open(path, "w") as f:
                json.dump(data, f)
        except OSError:
            pass  # the line is on stderr already
