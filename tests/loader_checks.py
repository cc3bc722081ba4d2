"""Checks shared by the data-loader tests."""

from collections.abc import Callable

import torch


def assert_resumes_exactly(make_loader: Callable[[], object], skip: int, check: int) -> None:
    """A loader restored from its state after `skip` batches yields, key by key, the next
    `check` batches of an uninterrupted one."""
    ref_loader = make_loader()
    ref = iter(ref_loader)
    for _ in range(skip):
        next(ref)
    state = ref_loader.state_dict()
    expected = [next(ref) for _ in range(check)]
    resumed_loader = make_loader()
    resumed_loader.load_state_dict(state)
    resumed = iter(resumed_loader)
    for want in expected:
        got = next(resumed)
        for k in want:
            assert torch.equal(got[k], want[k]), k
