"""SIGTERM (preemption): the run stops at the end of the step in flight and saves it, as long as
that step ends within training.sigterm_grace_seconds.

The handler only sets `requested`; the trainer reads it after each step (all ranks agree through
one all-reduce) and saves. A step that never ends (a hung data read, a chat template that loops,
a rank stuck in a collective) would keep the process alive until the scheduler's SIGKILL, with no
word of why. So a SIGTERM also starts a timer over the step in flight (or over the next step, when
it came between two): if that step has not ended when the grace runs out, a daemon thread writes
one line, releases the dump-folder lock and ends the process at once with EXIT_CODE (os._exit:
the main thread may be stuck in C code that no exception reaches). Nothing is saved then: the
state of a step cut in the middle is not a checkpoint. The save after a step that did end is not
timed.
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

logger = logging.getLogger("torchtitan_ablate")

EXIT_CODE = 143  # 128 + SIGTERM, what a process killed by SIGTERM returns
KEY = "training.sigterm_grace_seconds"


class Preemption:
    """SIGTERM -> `requested`, and a bounded wait for the step in flight.

    The trainer calls install() before its loop, step_started(step) / step_ended() around each
    step (step_ended once every rank knows whether to stop) and restore() after it.
    `on_expiry(step)` returns the clause naming what is kept (the newest checkpoint) and frees
    what the process holds; `exit` ends the process (a seam for tests)."""

    def __init__(
        self,
        grace_seconds: float,
        on_expiry: Callable[[int], str] = lambda step: "",
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.grace_seconds, self.on_expiry, self.exit = grace_seconds, on_expiry, exit
        self.requested = False
        self.step, self.in_step = 0, False
        self._timer: threading.Timer | None = None
        # Re-entrant: the handler runs on the main thread, maybe inside step_ended's block.
        self._lock = threading.RLock()
        self._previous: object = None

    def install(self) -> None:
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def restore(self) -> None:
        """Stops the timer and gives the process its own SIGTERM handling back (tests,
        notebooks and processes that go on after train())."""
        self.step_ended()
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

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

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        grace = f"{self.grace_seconds:g} s" if self._bounded() else "no limit"
        logger.warning(
            f"SIGTERM: stopping at the end of this step, with every rank ({KEY} = {grace})"
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
            world = int(os.environ.get("WORLD_SIZE", 1))
            rank = f"rank {os.environ.get('RANK', '?')}: " if world > 1 else ""
            kept = self.on_expiry(step)
            report(
                f"error: {rank}step {step} did not end within {KEY} = {self.grace_seconds:g} s "
                f"of SIGTERM (a hung data read, template or collective): stopped without saving "
                f"it{kept}",
                EXIT_CODE,
            )
            sys.stdout.flush()
            self.exit(EXIT_CODE)
