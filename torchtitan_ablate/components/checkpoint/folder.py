"""The checkpoint folder on disk: which `step-<N>` directories count, and every change to them
made so that a crash at any point leaves each step either complete or recoverable.

Names in `<folder>/`:
  - `step-<N>/`: a checkpoint; it counts once DCP has written its `.metadata` (written last).
  - `step-<N>.tmp/`: a save in progress; renamed to `step-<N>/` when complete, else stale.
  - `step-<N>.replaced/`: the previous `step-<N>` while a re-save of that step swaps in the new
    one; restored at start if the swap died before the new one was in place, else removed.
  - `*.deleting/`: renamed there before removal, so a crash mid-delete never leaves a broken
    `step-<N>`; removed at start.
  - `abandoned/<time>/step-<N>/`: steps newer than an explicit `load_step`, kept (never pruned)
    so that no later resume picks a step of the run that was abandoned.
Only rank 0 calls the functions that change the folder; the caller holds the barriers.
"""

import logging
import os
import re
import shutil
import time

logger = logging.getLogger(__name__)

METADATA = ".metadata"  # written last by DCP's coordinator: its presence marks a complete save
ABANDONED = "abandoned"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_REPLACED_DIR = re.compile(r"^step-(\d+)\.replaced$")
_STALE_DIR = re.compile(r"^step-\d+(\.replaced)?\.(tmp|deleting)$")


def step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


def complete_steps(folder: str, warn: bool = True) -> list[int]:
    """Steps in `folder` whose save finished (a `step-<N>` directory holding `.metadata`)."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        match = _STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(folder, name, METADATA)):
            steps.append(int(match.group(1)))
        elif match and warn:
            logger.warning(f"ignoring {folder}/{name}: no {METADATA}, not complete")
    return sorted(steps)


def recover(folder: str) -> None:
    """Undoes what a crash left half-done: restores a replaced step whose replacement never
    arrived, then removes unfinished saves and deletes."""
    names = os.listdir(folder)
    for name in names:
        if match := _REPLACED_DIR.match(name):
            side, final = os.path.join(folder, name), step_dir(folder, int(match.group(1)))
            if os.path.exists(final):  # the swap finished: the side copy is the superseded one
                remove(side)
            else:
                os.rename(side, final)
                _fsync_dir(folder)
                logger.warning(f"restored {final} from {side} (a re-save of that step died)")
    for name in os.listdir(folder):
        if _STALE_DIR.match(name):
            logger.warning(f"removing incomplete checkpoint {folder}/{name}")
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def replace(tmp: str, final: str) -> None:
    """Renames the finished save `tmp` to `final`. An existing `final` is first moved to its side
    name and removed only once the new one is in place: at every instant one complete copy of the
    step is on disk under a name `recover` knows."""
    folder = os.path.dirname(final)
    _fsync_dir(tmp)
    side = f"{final}.replaced"
    had_old = os.path.exists(final)
    if had_old:
        if os.path.exists(side):  # a leftover; `final` is the complete copy
            remove(side)
        os.rename(final, side)
        _fsync_dir(folder)
    os.rename(tmp, final)
    _fsync_dir(folder)
    if had_old:
        remove(side)


def set_aside_newer(folder: str, step: int) -> tuple[list[int], str | None]:
    """Moves every `step-<M>` with M > `step` (complete or not) into a new
    `<folder>/abandoned/<time>/`; returns the steps moved and where to (None if none)."""
    newer = sorted(
        int(m.group(1))
        for name in os.listdir(folder)
        if (m := _STEP_DIR.match(name)) and int(m.group(1)) > step
    )
    if not newer:
        return [], None
    base = os.path.join(folder, ABANDONED, time.strftime("%Y%m%d-%H%M%S"))
    dest, n = base, 1
    while os.path.exists(dest):
        dest, n = f"{base}-{n}", n + 1
    os.makedirs(dest)
    # Newest first: if this dies midway, what stays behind is the older part of that run.
    for s in reversed(newer):
        os.rename(step_dir(folder, s), step_dir(dest, s))
    _fsync_dir(dest)
    _fsync_dir(folder)
    return newer, dest


def prune(folder: str, keep_latest_k: int, keep: int) -> None:
    """Keeps `keep` (the step just saved) and the newest `keep_latest_k - 1` other complete
    steps (<= 0 keeps all). `keep` is spared even when a newer step exists."""
    if keep_latest_k <= 0:
        return
    others = [s for s in complete_steps(folder, warn=False) if s != keep]
    for old in others[: max(0, len(others) - (keep_latest_k - 1))]:
        remove(step_dir(folder, old))


def remove(path: str) -> None:
    """Renames first, so a crash mid-delete leaves a `.deleting` dir, never a broken `step-N`."""
    trash = f"{path}.deleting"
    if os.path.exists(trash):
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _fsync_dir(path: str) -> None:
    """Makes renames and new entries in `path` durable (no-op where dirs cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
