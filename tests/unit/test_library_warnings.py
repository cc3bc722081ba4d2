"""torchtitan_ablate/library_warnings.py: the listed library warnings are dropped, ours and other
libraries' still show, and -W / PYTHONWARNINGS turns the start-up filter off. The console of a
whole 2-rank run is checked in tests/integration/test_launcher.py."""

import logging
import sys
import warnings

import pytest

from torchtitan_ablate import library_warnings
from torchtitan_ablate.library_warnings import LOG_FILTERS, filter_library_warnings, ignored

DCP = "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load"
DCP_MODULE = "torch.distributed.checkpoint.utils"  # where DCP's warning is attributed
HOOKS = "Using `torch.compile(module)` when there are global hooks on modules (e.g., ...)"


def _shown(message: str, module: str, category: type[Warning] = UserWarning) -> bool:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        filter_library_warnings()
        warnings.warn_explicit(message, category, "x.py", 1, module=module)
    return bool(seen)


@pytest.fixture
def no_warnoptions(monkeypatch):
    monkeypatch.setattr(sys, "warnoptions", [])


@pytest.fixture(autouse=True)
def log_filters_restored():
    """filter_library_warnings adds logging filters for the process; a test's stay in it."""
    loggers = [logging.getLogger(name) for name, _ in LOG_FILTERS]
    before = [list(log.filters) for log in loggers]
    yield
    for log, filters in zip(loggers, before, strict=True):
        log.filters[:] = filters


@pytest.mark.usefixtures("no_warnoptions")
def test_the_listed_warnings_are_dropped_and_others_shown():
    assert not _shown(DCP, DCP_MODULE)
    assert not _shown(HOOKS, "torchtitan_ablate.models.qwen3.model")
    assert not _shown("'set_vital' is deprecated, please do not call", "torchdata.stateful")
    # The same text from elsewhere, or another warning of the same library, still shows.
    assert _shown(DCP, "torchtitan_ablate.train")
    assert _shown("'set_vital' is deprecated, please do not call", "torchtitan_ablate.x")
    assert _shown("TypedStorage is deprecated", "torch.storage")
    assert _shown(DCP, DCP_MODULE, DeprecationWarning)
    # Ours: the trainer's warnings go through logging; a warnings.warn of ours still shows.
    assert _shown("packing: a document longer than seq_len was cut", "torchtitan_ablate.data")


def test_with_warnoptions_the_user_decides(monkeypatch):
    monkeypatch.setattr(sys, "warnoptions", ["default"])
    assert _shown(DCP, DCP_MODULE)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with ignored():  # a call that warns of what it does on purpose stays quiet
            warnings.warn_explicit(DCP, UserWarning, "x.py", 1, module=DCP_MODULE)
    assert not seen


@pytest.mark.usefixtures("no_warnoptions")
def test_torchao_pytree_log_line_dropped_and_other_records_kept(caplog):
    name, _ = LOG_FILTERS[0]
    log = logging.getLogger(name)
    log.filters[:] = []
    with warnings.catch_warnings():
        filter_library_warnings()
        filter_library_warnings()  # once per process is the aim; twice adds no second filter
    assert len(log.filters) == 1
    with caplog.at_level(logging.WARNING, logger=name):
        log.warning("%s is an Enum subclass and is now natively supported by ...", "<enum 'K'>")
        log.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]


def test_ignored_restores_the_callers_filters():
    before = list(warnings.filters)
    with ignored():
        assert len(warnings.filters) == len(before) + len(library_warnings.FILTERS)
    assert warnings.filters == before
