"""SIGTERM (preemption): the run stops at the end of the step in flight and saves it, as long as
that step ends within training.sigterm_grace_seconds.

The handler only sets `requested`; the trainer reads it after each step (all ranks agree through
one all-reduce, whose answer several ranks read a step late: they stop at the next step's end)
and saves. A step that never ends (a hung data read, a chat template that loops, a rank stuck in
a collective) would keep the process alive until the scheduler's SIGKILL, with no word of why.
So a SIGTERM also starts a timer over the step in flight (or over the next step, when it came
between two): if that step has not ended when the grace runs out, a daemon thread writes one
line, releases the dump-folder lock and ends the process at once with EXIT_CODE (os._exit: the
main thread may be stuck in C code that no exception reaches). Nothing is saved then: the state
of a step cut in the middle is not a checkpoint. The save after a step that did end is not timed.

Ctrl-C (SIGINT) is treated as a SIGTERM the first time, and the process then exits with
EXIT_INTERRUPTED (what a shell expects of a Ctrl-C) once the step is saved; a second Ctrl-C (or a
SIGTERM after it: torchrun's answer to a second Ctrl-C) ends it at once with one line and that
code, without saving the step in flight.
"""

import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

from torchtitan_ablate.config.errors import report
from torchtitan_ablate.distributed.utils import current_world_size

logger = logging.getLogger("torchtitan_ablate")

EXIT_CODE = 143  # 128 + SIGTERM, what a process killed by SIGTERM returns
EXIT_INTERRUPTED = 130  # 128 + SIGINT: a Ctrl-C
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
KEY = "training.sigterm_grace_seconds"


class Preemption:
    """SIGTERM or a first Ctrl-C -> `requested`, and a bounded wait for the step in flight.

    The trainer calls install() before its loop, step_started(step) / step_ended() around each
    step (step_ended once every rank knows whether to stop), restore() after it and, once the
    run is over, exit_if_interrupted(). `on_abort(step)` returns the clause naming what is kept
    (the newest checkpoint) and frees what the process holds; `exit` ends the process (a seam
    for tests)."""

    def __init__(
        self,
        grace_seconds: float,
        on_abort: Callable[[int], str] = lambda step: "",
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.grace_seconds, self.on_abort, self.exit = grace_seconds, on_abort, exit
        self.requested, self.interrupted = False, False  # interrupted: by a Ctrl-C
        self.step, self.in_step = 0, False
        self._timer: threading.Timer | None = None
        # Re-entrant: the handler runs on the main thread, maybe inside step_ended's block.
        self._lock = threading.RLock()
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in _SIGNALS}

    def restore(self) -> None:
        """Stops the timer and gives the process its own SIGTERM and SIGINT handling back
        (tests, notebooks and processes that go on after train())."""
        self.step_ended()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def stop_reason(self) -> str:
        """The signal that stopped the run, for its log line: Ctrl-C or SIGTERM."""
        return "Ctrl-C" if self.interrupted else "SIGTERM"

    def exit_if_interrupted(self) -> None:
        """After a run that a Ctrl-C stopped (and saved): exit code 130, as a shell expects."""
        if self.interrupted:
            raise SystemExit(EXIT_INTERRUPTED)

    def step_started(self, step: int) -> None:
        self.step, self.in_step = step, True
        if self.requested:  # the signal came between two steps: this one gets the grace
            self._arm()

    def step_ended(self) -> None:
        with self._lock:
            self.in_step = False
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Under torchrun the workers get no Ctrl-C of their own: it forwards the first as SIGINT
        # and answers a second with SIGTERM.
        if (signum == signal.SIGINT and self.requested) or self.interrupted:
            what = "a second Ctrl-C" if signum == signal.SIGINT else "SIGTERM after a Ctrl-C"
            why = f"{what}: stopped at once, step {self.step} not saved"
            self._end(self.step, why, EXIT_INTERRUPTED)
            return
        grace = f"{self.grace_seconds:g} s" if self._bounded() else "no limit"
        # Several ranks read their vote a step late (the trainer's AnyRankLater).
        when = "this step or the next" if current_world_size() > 1 else "this step"
        if signum == signal.SIGINT:
            self.interrupted = True
            logger.warning(
                f"Ctrl-C: stopping at the end of {when} and saving it when checkpointing is "
                f"on, with every rank ({KEY} = {grace}); Ctrl-C again stops at once, unsaved"
            )
        else:
            logger.warning(
                f"SIGTERM: stopping at the end of {when}, with every rank ({KEY} = {grace})"
            )
        self.requested = True
        if self.in_step:
            self._arm()

    def _bounded(self) -> bool:
        return 0 < self.grace_seconds < math.inf

    def _arm(self) -> None:
        with self._lock:
            if self._timer is not None or not self._bounded():
                return
            self._timer = threading.Timer(self.grace_seconds, self._expire, args=(self.step,))
            self._timer.daemon = True
            self._timer.start()

    def _expire(self, step: int) -> None:
        with self._lock:
            if self._timer is not threading.current_thread():  # that step ended meanwhile
                return
            what = "Ctrl-C" if self.interrupted else "SIGTERM"
            self._end(
                step,
                f"step {step} did not end within {KEY} = {self.grace_seconds:g} s of {what} (a "
                "hung data read, template or collective): stopped without saving it",
                EXIT_CODE,
            )

    def _end(self, step: int, why: str, code: int) -> None:
        """One line, what is kept freed and named, and the process ends with `code`."""
        world = int(os.environ.get("WORLD_SIZE", 1))
        rank = f"rank {os.environ.get('RANK', '?')}: " if world > 1 else ""
        kept = self.on_abort(step)
        report(f"error: {rank}{why}{kept}", code)
        sys.stdout.flush()
        self.exit(code)
