"""Suite-wide settings: one CPU thread per process, and the expected duration, said when the
run starts."""

import logging
import os

import pytest

# One intra-op thread in this process and every process it starts (before torch is imported:
# the test modules import it after this file). The tensors here are tiny, so a second thread
# gains little on a quiet machine, while on a loaded one OpenMP's spinning threads made a 1.8 s
# test take 15 s (2 cores, load 2.5).
os.environ["OMP_NUM_THREADS"] = "1"

# Measured with scripts/run_tests.sh (2 pytest-xdist workers) on an idle 2-core machine: 8:45
# for 1812 tests (dev/LOG.md has the runs; a busy machine takes up to twice as long).
FULL_SUITE_MINUTES = 10
FULL_SUITE_TESTS = 1815


@pytest.fixture(autouse=True)
def _package_log_level():
    """Each test leaves the package's logger at the level it found. estimate_main quiets it to
    WARNING in its process (the CLI's behaviour), and a test that ran it in-process silenced the
    INFO lines that later tests read through caplog: under pytest-xdist the order of the tests
    on a worker differs from one run to the next."""
    log = logging.getLogger("torchtitan_ablate")
    level = log.level
    yield
    log.setLevel(level)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Multi-process and long tests first (stable: a module's tests stay together): pytest-xdist
    # then ends the run on short tests that the idle worker steals, instead of one worker
    # finishing a two-minute test alone at the end.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _say_expected_duration(config: pytest.Config, selected: int, after: bool = False) -> None:
    # A newcomer cannot tell a slow suite from a hung one: say what to expect. Multi-rank tests
    # print nothing while their ranks run (up to about half a minute each on 2 cores).
    if selected < 0.8 * FULL_SUITE_TESTS or config.option.collectonly:
        return  # a part of the suite: its time says little about the whole
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        if after and getattr(reporter, "isatty", False):
            reporter.write("\n")  # below xdist's status line, which a terminal rewrites in place
        reporter.write_line(
            f"{selected} tests: about {FULL_SUITE_MINUTES} min on 2 CPU cores (longer on a busy "
            "machine); a test that hangs is stopped after 600 s with every thread's stack"
        )


def pytest_collection_finish(session: pytest.Session) -> None:
    # In one process. Under pytest-xdist (-n) the workers collect, and their output is not shown:
    # the controller says it once the first worker has collected (below).
    if not hasattr(session.config, "workerinput"):
        _say_expected_duration(session.config, len(session.items))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids) -> None:
    config = node.config
    if not getattr(config, "_suite_duration_said", False):
        config._suite_duration_said = True
        _say_expected_duration(config, len(ids), after=True)
