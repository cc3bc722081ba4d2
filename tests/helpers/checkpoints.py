"""A CheckpointManager over one model, optimizer and schedule, saving every step, keeping all."""

from pathlib import Path
from typing import Any

from torch import nn

from torchtitan_ablate.components.checkpoint.manager import CheckpointManager


def one_model_manager(
    folder: Path,
    model: nn.Module,
    opt: Any,
    sched: Any,
    settings: dict | None = None,
    dataloader: Any | None = None,
) -> CheckpointManager:
    return CheckpointManager(
        folder=str(folder),
        enable=True,
        interval=1,
        keep_latest_k=0,
        model_parts=[model],
        optimizers=[opt],
        lr_schedulers=[sched],
        dataloader=dataloader,
        settings=settings,
    )
