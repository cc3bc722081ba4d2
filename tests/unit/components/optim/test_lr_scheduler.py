"""The learning-rate schedule: warmup, stable phase (WSD), decay shapes, short runs."""

import logging

import pytest
import torch

from torchtitan_ablate.components.optim.lr_scheduler import build_lr_scheduler, lr_factor
from torchtitan_ablate.config.optim_config import LRScheduler


def test_warmup_then_linear_decay_to_min():
    cfg = LRScheduler(warmup_steps=4, decay_type="linear", min_lr_factor=0.1)
    assert [lr_factor(s, 10, cfg) for s in (1, 2, 4)] == pytest.approx([0.2, 0.4, 0.8])
    assert lr_factor(5, 10, cfg) == pytest.approx(0.1 + 0.9 * (1 - 1 / 6))
    assert lr_factor(10, 10, cfg) == pytest.approx(0.1)


def test_wsd_keeps_the_peak_until_the_decay_phase():
    cfg = LRScheduler(warmup_steps=2, decay_ratio=0.2, decay_type="cosine")
    assert [lr_factor(s, 10, cfg) for s in (3, 8)] == [1.0, 1.0]
    assert lr_factor(9, 10, cfg) == pytest.approx(0.5)
    assert lr_factor(10, 10, cfg) == pytest.approx(0.0)


def test_warmup_longer_than_the_run_is_squeezed_and_said(caplog):
    cfg = LRScheduler(warmup_steps=100, decay_type="cosine")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with caplog.at_level(logging.WARNING, logger="torchtitan_ablate"):
        sched = build_lr_scheduler(opt, cfg, total_steps=20)
    assert "warmup shortened to 20 steps" in caplog.text
    lrs = []
    for _ in range(20):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[-1] == pytest.approx(20 / 21)  # peak at the last step
    # The first 20 steps of the 1000-step recipe are still warming up (step / 101).
    assert lr_factor(20, 1000, cfg) == pytest.approx(20 / 101)


@pytest.mark.parametrize("decay_type", ["linear", "cosine", "sqrt"])
def test_past_the_last_step_the_lr_stays_at_its_floor(decay_type):
    """A run extended on resume steps past the old last step: never a negative LR."""
    cfg = LRScheduler(warmup_steps=5, decay_type=decay_type, min_lr_factor=0.1)
    assert [lr_factor(s, 8, cfg) for s in (8, 9, 20)] == pytest.approx([0.1] * 3)


def test_warmup_ratio_is_a_share_of_the_final_steps(caplog):
    """warmup_ratio 0.25 of 20 steps warms up over 5, as warmup_steps 5 does; of 40, over 10.
    warmup_steps is then unused, so its default beyond a short run says nothing."""
    ratio = LRScheduler(warmup_steps=100, warmup_ratio=0.25, decay_type="cosine")
    for steps, warmup in ((20, 5), (40, 10)):
        fixed = LRScheduler(warmup_steps=warmup, decay_type="cosine")
        assert [lr_factor(s, steps, ratio) for s in range(1, steps + 1)] == [
            lr_factor(s, steps, fixed) for s in range(1, steps + 1)
        ]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with caplog.at_level(logging.WARNING, logger="torchtitan_ablate"):
        build_lr_scheduler(opt, ratio, total_steps=20)
    assert "warmup shortened" not in caplog.text
