"""SIGTERM during a step: the step that ends within training.sigterm_grace_seconds is left to the
trainer (stop and save); one that does not ends the process with one line and exit code 143."""

import os
import signal
import threading
import time

import pytest

from torchtitan_ablate.components.preemption import EXIT_CODE, EXIT_INTERRUPTED, Preemption


class _Exits:
    """Preemption's `exit` seam: records the code instead of ending the test process."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.done = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


@pytest.fixture
def preemption():
    made = []

    def make(grace: float) -> tuple[Preemption, _Exits]:
        exits = _Exits()
        p = Preemption(grace, on_abort=lambda step: " (newest checkpoint: step-1)", exit=exits)
        p.install()
        made.append(p)
        return p, exits

    yield make
    for p in made:
        p.restore()


def test_a_step_that_never_ends_exits_with_one_line_after_the_grace(preemption, capsys):
    p, exits = preemption(0.3)
    p.step_started(2)
    start = time.monotonic()
    os.kill(os.getpid(), signal.SIGTERM)
    assert exits.done.wait(5), "no exit after the grace period"
    assert 0.25 < time.monotonic() - start < 3
    assert exits.codes == [EXIT_CODE] == [143]
    assert capsys.readouterr().err.splitlines() == [
        "error: step 2 did not end within training.sigterm_grace_seconds = 0.3 s of SIGTERM "
        "(a hung data read, template or collective): stopped without saving it (newest "
        "checkpoint: step-1)"
    ]


def test_a_step_that_ends_within_the_grace_is_left_to_the_trainer(preemption):
    p, exits = preemption(0.5)
    p.step_started(1)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)  # the rest of the step
    p.step_ended()
    assert p.requested
    assert not exits.done.wait(1)  # the trainer saves and stops; the timer never fires


def test_a_sigterm_between_steps_times_the_next_step(preemption):
    p, exits = preemption(0.2)
    p.step_started(1)
    p.step_ended()
    os.kill(os.getpid(), signal.SIGTERM)  # during the save after step 1
    assert p.requested and not exits.done.wait(0.5)  # the save is not timed
    p.step_started(2)
    assert exits.done.wait(5) and exits.codes == [EXIT_CODE]


def test_a_grace_of_zero_waits_for_the_step(preemption):
    p, exits = preemption(0)
    p.step_started(1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert p.requested and not exits.done.wait(0.5)


def test_restore_gives_the_previous_handler_back():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda *a: seen.append(a[0]))
    try:
        p = Preemption(0.2, exit=lambda code: seen.append(code))
        p.install()
        p.step_started(1)
        os.kill(os.getpid(), signal.SIGTERM)
        p.restore()  # also stops the timer: a step that raised leaves no exit behind
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.4)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_first_ctrl_c_stops_at_the_step_end_and_a_second_at_once(preemption, capsys):
    p, exits = preemption(0)
    p.step_started(3)
    os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: the trainer finishes the step
    assert p.requested and p.interrupted and p.stop_reason() == "Ctrl-C"
    assert not exits.done.wait(0.3)
    os.kill(os.getpid(), signal.SIGINT)
    assert exits.done.wait(5) and exits.codes == [EXIT_INTERRUPTED] == [130]
    assert capsys.readouterr().err.splitlines() == [
        "error: a second Ctrl-C: stopped at once, step 3 not saved (newest checkpoint: step-1)"
    ]
    with pytest.raises(SystemExit) as e:
        p.exit_if_interrupted()  # the run a first Ctrl-C stopped, once saved
    assert e.value.code == 130


def test_a_sigterm_run_exits_as_before():
    before = signal.getsignal(signal.SIGINT)  # pytest's, or an earlier in-process trainer's
    p = Preemption(0)
    p.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert p.requested and not p.interrupted and p.stop_reason() == "SIGTERM"
        p.exit_if_interrupted()  # no exit: the trainer returns, exit code 0
    finally:
        p.restore()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_sigterm_after_a_ctrl_c_stops_at_once(preemption, capsys):
    # torchrun forwards a first Ctrl-C as SIGINT and answers a second with SIGTERM.
    p, exits = preemption(0)
    p.step_started(4)
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)
    assert exits.done.wait(5) and exits.codes == [130]
    assert capsys.readouterr().err.splitlines() == [
        "error: SIGTERM after a Ctrl-C: stopped at once, step 4 not saved (newest checkpoint: "
        "step-1)"
    ]
