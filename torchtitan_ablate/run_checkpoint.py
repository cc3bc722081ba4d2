"""The trainer's checkpoint manager: what a training run saves, restores and checks on resume.

One place names the run's stateful parts (model parts, optimizer, schedule, loader, the train
state and DPO's reference) and the settings a resume must match (run_settings.py).
"""

import os

from torchtitan_ablate.build import Run
from torchtitan_ablate.components.checkpoint.manager import CheckpointManager
from torchtitan_ablate.components.checkpoint.run_settings import run_settings
from torchtitan_ablate.components.checkpoint.state import TrainState
from torchtitan_ablate.components.data import state_same_on_every_rank
from torchtitan_ablate.components.objective.dpo import reference_states
from torchtitan_ablate.config import JobConfig
from torchtitan_ablate.layout import Layout


def build_checkpointer(
    config: JobConfig, layout: Layout, run: Run, dataloader: object, train_state: TrainState
) -> CheckpointManager:
    """The manager of `config.checkpoint` for a built run. tokens_seen rides in train_state, so
    a resumed run's count is exact (metrics.jsonl may hold no row at the checkpoint's step)."""
    ckpt, training = config.checkpoint, config.training
    return CheckpointManager(
        folder=os.path.join(config.job.dump_folder, ckpt.folder),
        enable=ckpt.enable,
        interval=ckpt.interval,
        keep_latest_k=ckpt.keep_latest_k,
        model_parts=run.model_parts,
        optimizers=[run.optimizer],
        lr_schedulers=[run.lr_scheduler],
        dataloader=dataloader,
        initial_load_path=ckpt.initial_load_path,
        initial_load_format=ckpt.initial_load_format,
        load_step=ckpt.load_step,
        training_steps=training.steps,
        settings=run_settings(config, layout.sequences_per_step, layout.model_args),
        dataloader_state_shared=state_same_on_every_rank(
            training.data_sharding, training.num_workers
        ),
        states={"train_state": train_state, **reference_states(run.reference)},
    )
