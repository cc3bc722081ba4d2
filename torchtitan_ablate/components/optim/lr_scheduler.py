"""Warmup, optional stable phase, then linear / cosine / sqrt decay (WSD when decay_ratio set).

The learning rate is a function of this run's config and the step only: a resumed run restores
the step (`set_schedule_step`), never the checkpoint's peak LR or schedule, so extending a run
(more training.steps) or changing optimizer.lr / lr_scheduler.* on resume takes effect at once.
"""

import logging
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from torchtitan_ablate.config.derived import resolved_warmup_steps
from torchtitan_ablate.config.optim_config import LRScheduler as LRSchedulerConfig

logger = logging.getLogger("torchtitan_ablate")


def lr_factor(step: int, total_steps: int, config: LRSchedulerConfig) -> float:
    """Multiplier of the peak LR for 1-based optimizer `step` (LambdaLR passes step - 1)."""
    warmup = min(resolved_warmup_steps(config, total_steps), total_steps)
    if step <= warmup:
        # Starts above zero so the first step already moves the weights.
        return step / (warmup + 1)
    decay_steps = total_steps - warmup
    if config.decay_ratio is not None:
        decay_steps = round(total_steps * config.decay_ratio)
    decay_start = total_steps - decay_steps
    if step <= decay_start or decay_steps == 0:
        return 1.0
    # Clamped: past the last step (a run extended on resume) the LR stays at its floor instead
    # of turning negative.
    progress = min((step - decay_start) / decay_steps, 1.0)
    if config.decay_type == "linear":
        shape = 1.0 - progress
    elif config.decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - math.sqrt(progress)
    return config.min_lr_factor + (1.0 - config.min_lr_factor) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, config: LRSchedulerConfig, total_steps: int
) -> LambdaLR:
    """LambdaLR over total_steps (training.steps, final: derived from training.epochs where
    set); the warmup is lr_scheduler.warmup_steps or ceil(warmup_ratio x total_steps)."""
    if config.warmup_steps > total_steps and config.warmup_ratio is None:
        # As torchtitan, the warmup is squeezed into the run; said out loud, because a short run
        # then peaks at its last step and is not the first steps of the longer recipe.
        logger.warning(
            f"lr_scheduler.warmup_steps = {config.warmup_steps} > training.steps = "
            f"{total_steps}: warmup shortened to {total_steps} steps (the lr peaks at the last "
            "step); to run the first steps of a longer schedule keep its training.steps and "
            "stop early with training.exit_at_step"
        )
    return LambdaLR(optimizer, lambda i: lr_factor(i + 1, total_steps, config))


def set_schedule_step(scheduler: LambdaLR, step: int) -> None:
    """Puts `scheduler` at `step` (its `last_epoch`) with the LR its own peak LRs and factors
    give there, written into the optimizer: what a resume restores instead of the saved LRs."""
    scheduler.last_epoch = step
    lrs = [base * f(step) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
