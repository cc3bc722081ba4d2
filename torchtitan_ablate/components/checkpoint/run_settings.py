"""The settings a checkpoint records, so that a resume with other values says what changed.

On resume this run's config decides how to step (state.py keeps the optimizer's
hyperparameters and recomputes the LR from the step), so a changed key is applied, never
silently overridden by the checkpoint. What changed is stated, one line per key: the LR schedule
(training.steps, optimizer.lr, lr_scheduler.*), the optimizer (its other keys, max_norm) and the
batch (seq_len, batch sizes, sequences per step). Every key of the optimizer and lr_scheduler
sections is recorded, so a key added later is covered without a change here.
"""

import dataclasses
from typing import Any

from torchtitan_ablate.config import JobConfig

SEQUENCES_PER_STEP = "sequences per optimizer step"
_SCHEDULE = ("training.steps", "optimizer.lr")
_BATCH = (
    "training.seq_len",
    "training.local_batch_size",
    "training.global_batch_size",
    SEQUENCES_PER_STEP,
)


def run_settings(config: JobConfig, sequences_per_step: int) -> dict[str, Any]:
    """The settings to record in each checkpoint, as "section.key" -> value.

    sequences_per_step: local_batch_size x data-parallel degree x accumulation, which changes
    with the number of ranks when global_batch_size is -1."""
    settings: dict[str, Any] = {}
    for section in ("optimizer", "lr_scheduler"):
        for key, value in dataclasses.asdict(getattr(config, section)).items():
            settings[f"{section}.{key}"] = value
    for key in ("steps", "max_norm", "seq_len", "local_batch_size", "global_batch_size"):
        settings[f"training.{key}"] = getattr(config.training, key)
    settings[SEQUENCES_PER_STEP] = sequences_per_step
    return settings


def describe_changes(saved: dict[str, Any], current: dict[str, Any], step: int) -> list[str]:
    """One line per setting that differs between a checkpoint (`saved`, at `step`) and this run,
    the schedule first, then the optimizer, then the batch; a key one side lacks (recorded by
    another version) shows as "unset"."""
    kinds = (
        ("lr schedule", f"the lr from step {step + 1} on follows this run's schedule"),
        ("optimizer", f"applied from step {step + 1}"),
        ("batch", "the data continues from the checkpoint's position"),
    )
    lines = []
    for key in sorted(set(saved) | set(current), key=lambda k: (_kind(k), k)):
        old, new = saved.get(key, "unset"), current.get(key, "unset")
        if old != new:
            what, effect = kinds[_kind(key)]
            lines.append(f"{what} changed on resume: {key} {old} -> {new} ({effect})")
    return lines


def _kind(key: str) -> int:
    """0: shapes the LR schedule, 1: the optimizer's step, 2: the batch."""
    if key in _SCHEDULE or key.startswith("lr_scheduler."):
        return 0
    return 2 if key in _BATCH else 1
