"""Resuming with changed settings: the LR schedule follows this run's config and the step, every
optimizer / schedule key is applied, and each change is stated in one log line."""

import logging

import pytest
import torch
from torch import nn

from tests.helpers.checkpoints import one_model_manager
from torchtitan_ablate.components.checkpoint.run_settings import describe_changes, run_settings
from torchtitan_ablate.components.optim.lr_scheduler import build_lr_scheduler
from torchtitan_ablate.components.optim.optimizer import build_optimizer
from torchtitan_ablate.config import JobConfig


def _config(**changes: object) -> JobConfig:
    """JobConfig() with `changes` given as {"section.key": value}."""
    config = JobConfig()
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)
    return config


def _build(config: JobConfig) -> tuple:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = build_optimizer([model], config.optimizer, "cpu")
    return model, opt, build_lr_scheduler(opt, config.lr_scheduler, config.training.steps)


def _manager(folder, config: JobConfig, model, opt, sched, settings: bool = True):
    recorded = run_settings(config, sequences_per_step=8) if settings else None
    return one_model_manager(folder, model, opt, sched, recorded)


def _train(model, opt, sched, n: int) -> list[float]:
    """n optimizer steps; returns the lr each one ran at."""
    lrs = []
    for _ in range(n):
        lrs.append(opt.param_groups[0]["lr"])
        model(torch.ones(3, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return lrs


def _group_settings(opt: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _changes(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "changed on resume" in r.getMessage()]


@pytest.mark.parametrize("done, total", [(8, 12), (5, 10)])
def test_extending_a_run_follows_the_longer_schedule(tmp_path, caplog, done, total):
    """8 -> 12 steps ran step 9 at a negative lr; 5 -> 10 with 5 warmup steps jumped to the
    peak at step 6. Both now run each resumed step at the lr of a fresh `total`-step run."""
    first = _config(**{"training.steps": done, "lr_scheduler.warmup_steps": 5})
    model, opt, sched = _build(first)
    _train(model, opt, sched, done)
    _manager(tmp_path, first, model, opt, sched).save(done)

    longer = _config(**{"training.steps": total, "lr_scheduler.warmup_steps": 5})
    model, opt, sched = _build(longer)
    with caplog.at_level(logging.INFO):
        assert _manager(tmp_path, longer, model, opt, sched).load() == done
    resumed = _train(model, opt, sched, total - done)
    fresh = _train(*_build(longer), total)[done:]
    assert resumed == fresh and min(resumed) >= 0
    assert _changes(caplog) == [
        f"lr schedule changed on resume: training.steps {done} -> {total} (the lr from step "
        f"{done + 1} on follows this run's schedule)"
    ]


@pytest.mark.parametrize(
    "key, value",
    [
        ("optimizer.lr", 5e-4),
        ("optimizer.weight_decay", 0.01),
        ("optimizer.beta1", 0.8),
        ("optimizer.beta2", 0.99),
        ("optimizer.eps", 1e-6),
        ("optimizer.name", "Adam"),
        ("optimizer.implementation", "for-loop"),
        ("lr_scheduler.warmup_steps", 1),
        ("lr_scheduler.decay_ratio", 0.3),
        ("lr_scheduler.decay_type", "cosine"),
        ("lr_scheduler.min_lr_factor", 0.1),
        ("training.steps", 12),
        ("training.max_norm", 0.5),
    ],
)
def test_a_setting_changed_on_resume_is_applied_and_logged(tmp_path, caplog, key, value):
    # Saved at step 6 of 10, in the decay phase: every schedule key shapes the next lr.
    base = _config(**{"training.steps": 10})
    model, opt, sched = _build(base)
    _train(model, opt, sched, 6)
    _manager(tmp_path, base, model, opt, sched).save(6)
    old = run_settings(base, 8)[key]

    changed = _config(**{"training.steps": 10, key: value})
    model, opt, sched = _build(changed)
    with caplog.at_level(logging.INFO):
        _manager(tmp_path, changed, model, opt, sched).load()
    fresh = _build(changed)
    _train(*fresh, 6)
    # Every hyperparameter (the lr at this step included) is the new config's, as in a fresh
    # run of it; the moments and step counts are the checkpoint's.
    assert _group_settings(opt) == _group_settings(fresh[1])
    assert opt.state_dict()["state"][0]["step"] == 6
    assert sched.get_last_lr() == fresh[2].get_last_lr()
    (line,) = _changes(caplog)
    assert f" {key} {old} -> {value} (" in line


def test_batch_changes_are_stated():
    saved = run_settings(_config(), sequences_per_step=8)
    smaller = _config(**{"training.seq_len": 128, "training.local_batch_size": 4})
    effect = "(the data continues from the checkpoint's position)"
    assert describe_changes(saved, run_settings(smaller, 4), step=6) == [
        f"batch changed on resume: sequences per optimizer step 8 -> 4 {effect}",
        f"batch changed on resume: training.local_batch_size 8 -> 4 {effect}",
        f"batch changed on resume: training.seq_len 256 -> 128 {effect}",
    ]
    assert describe_changes(saved, saved, step=6) == []


def test_a_checkpoint_without_settings_still_resumes_on_this_runs_settings(tmp_path, caplog):
    """Checkpoints written before settings were recorded: this run's values apply, said once."""
    base = _config(**{"training.steps": 10})
    model, opt, sched = _build(base)
    _train(model, opt, sched, 4)
    _manager(tmp_path, base, model, opt, sched, settings=False).save(4)
    changed = _config(**{"training.steps": 10, "optimizer.lr": 5e-4})
    model, opt, sched = _build(changed)
    with caplog.at_level(logging.WARNING):
        assert _manager(tmp_path, changed, model, opt, sched).load() == 4
    assert "records no settings" in caplog.text
    fresh = _build(changed)
    _train(*fresh, 4)
    assert _group_settings(opt) == _group_settings(fresh[1])
