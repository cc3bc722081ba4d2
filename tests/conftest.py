"""Suite-wide settings: one CPU thread per process, and the expected duration, said when the
run starts."""

import os

import pytest

# One intra-op thread in this process and every process it starts (before torch is imported:
# the test modules import it after this file). The tensors here are tiny, so a second thread
# gains little on a quiet machine, while on a loaded one OpenMP's spinning threads made a 1.8 s
# test take 15 s (2 cores, load 2.5).
os.environ["OMP_NUM_THREADS"] = "1"

# Measured on a 2-core machine with one other job running (dev/LOG.md has the run); to be
# lowered with the suite (the target is 15 minutes).
FULL_SUITE_MINUTES = 25
FULL_SUITE_TESTS = 1650


def pytest_collection_finish(session: pytest.Session) -> None:
    # A newcomer cannot tell a slow suite from a hung one: say what to expect. Multi-rank tests
    # print nothing while their ranks run (up to about half a minute each on 2 cores).
    selected = len(session.items)
    if selected < 0.8 * FULL_SUITE_TESTS or session.config.option.collectonly:
        return  # a part of the suite: its time says little about the whole
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            f"{selected} tests: about {FULL_SUITE_MINUTES} min on 2 CPU cores (longer on a busy "
            "machine); a test that hangs is stopped after 600 s with every thread's stack"
        )
