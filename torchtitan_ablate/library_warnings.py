"""Warnings from torch and its libraries that a user of this engine cannot act on: each names a
choice this engine made on purpose, so on a newcomer's console it reads as a problem that is
not there. They are listed here, and only here.

Entry points (the trainer, the launcher, estimation.py, scripts/) call filter_library_warnings()
once at start-up; library code that triggers one of them on purpose runs it under ignored(), so
it is quiet outside those entry points too (tests, a notebook). Each filter matches one message
and a warning category, so another warning from the same library, and every warning of ours,
still shows. With -W or PYTHONWARNINGS set (PYTHONWARNINGS=default shows them) the user's
choice stands and the entry points filter nothing.
"""

import logging
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

# (message regex matched at the start of the message, category, module regex of where the
# warning is attributed: "" where torch attributes it to our caller's frame).
FILTERS: list[tuple[str, type[Warning], str]] = [
    # DCP on one process (no_dist=True: offline conversion, export, the checkpoint record read
    # by one rank alone) is what we asked for; DCP says so on every call.
    (
        r"torch\.distributed is disabled, unavailable or uninitialized",
        UserWarning,
        r"torch\.distributed\.checkpoint",
    ),
    # The estimator's memory tracker hooks every module globally (estimator/tracker.py) and
    # skips the compiled wrappers' extra call, which this warning is about.
    (r"Using `torch\.compile\(module\)` when there are global hooks", UserWarning, ""),
    # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13, whenever a loader starts.
    (r"'set_vital' is deprecated", UserWarning, r"torchdata\."),
]


# The same through logging: (logger, message regex matched at the start of the message).
LOG_FILTERS: list[tuple[str, str]] = [
    # torchao (float8) registers its KernelPreference enum as a pytree constant on import, which
    # torch 2.13 deprecates; on every rank of every float8 run.
    ("torch.utils._pytree", r"<enum '\w+'> is an Enum subclass and is now natively supported"),
]


class _DropMessages(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def filter_library_warnings() -> None:
    """Ignore FILTERS and LOG_FILTERS for the rest of the process, unless the user set -W or
    PYTHONWARNINGS."""
    if sys.warnoptions:
        return
    _ignore_warnings()
    for name, message in LOG_FILTERS:
        log = logging.getLogger(name)
        if not any(
            isinstance(f, _DropMessages) and f.pattern.pattern == message for f in log.filters
        ):
            log.addFilter(_DropMessages(message))


@contextmanager
def ignored() -> Iterator[None]:
    """FILTERS ignored inside the block only (the caller's filters come back after it)."""
    with warnings.catch_warnings():
        _ignore_warnings()  # -W or not: these calls warn of what they do on purpose
        yield


def _ignore_warnings() -> None:
    for message, category, module in FILTERS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
