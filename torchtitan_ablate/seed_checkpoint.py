"""`checkpoint.create_seed_checkpoint` (torchtitan's name): the initial weights written once.

One process builds the model through the build path (so the weights are exactly those a fresh
run of this seed starts from on this device), writes them as a model-only DCP checkpoint
`<dump_folder>/<checkpoint.folder>/step-0` and exits. Any layout then starts from it:
  - with `checkpoint.initial_load_path = <that folder>` (DCP reshards it on load), or
  - by training in the same dump folder with `checkpoint.enable = true`: resume finds step 0,
    a model-only checkpoint, and loads its weights (as torchtitan does).
The save is atomic as every checkpoint save is: `step-0.tmp`, renamed when complete, and it
holds the dump folder's lock (components/checkpoint/dump_lock.py) as a training run does.
"""

import logging
import os
import shutil

import torch
from torch import nn

from torchtitan_ablate.build import build_layout, build_model
from torchtitan_ablate.components.checkpoint import folder as ckpt_dir
from torchtitan_ablate.components.checkpoint.dump_lock import acquire
from torchtitan_ablate.components.checkpoint.state import ModelWrapper, dcp_save
from torchtitan_ablate.components.objective.finite import nonfinite_entries
from torchtitan_ablate.config import ConfigError, JobConfig, check_dump_folder, write_config
from torchtitan_ablate.distributed import utils as dist_utils

logger = logging.getLogger("torchtitan_ablate")


def create_seed_checkpoint(config: JobConfig) -> str:
    """Builds the model in this one process, writes its weights to step 0 of the checkpoint
    folder and logs one line saying how to use them; returns the checkpoint's path. The caller
    tears the process group down."""
    device = dist_utils.pick_device(config.training.device)
    check_dump_folder(config.job.dump_folder)
    world_size = dist_utils.init_distributed(device, config.comm.init_timeout_seconds)
    if world_size > 1:
        raise ConfigError(
            f"checkpoint.create_seed_checkpoint = true: this run has {world_size} processes; "
            "the seed checkpoint is written by one (NGPU=1, parallelism degrees 1), then every "
            "layout loads it through checkpoint.initial_load_path"
        )
    lock = acquire(config.job.dump_folder)  # a training run there would recover over the save
    try:
        layout = build_layout(config, world_size, device.type)
        [model], _ = build_model(config, layout.parallel_dims, layout.model_args, device)
        write_config(config, os.path.join(config.job.dump_folder, "config.toml"))
        path = write_seed_checkpoint(
            model, os.path.join(config.job.dump_folder, config.checkpoint.folder)
        )
    finally:
        lock.release()
    logger.info(
        f"seed checkpoint (seed {config.training.seed}, {device.type}) written to {path}; start "
        f"any layout from it with --checkpoint.initial_load_path {path}"
    )
    return path


@torch.no_grad()
def write_seed_checkpoint(model: nn.Module, folder: str) -> str:
    """The model's state dict as the model-only DCP checkpoint `<folder>/step-0` (replacing an
    older one atomically); one process. Returns its path."""
    os.makedirs(folder, exist_ok=True)
    ckpt_dir.recover(folder)
    final = ckpt_dir.step_dir(folder, 0)
    tmp = f"{final}.tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    state = ModelWrapper([model]).state_dict()
    count, names = nonfinite_entries(state)
    if count:  # an init rule gone wrong: never hand such weights to every layout
        raise ValueError(f"initial weights hold NaN/Inf ({', '.join(names)}): not saved")
    dcp_save(state, tmp)
    ckpt_dir.replace(tmp, final)
    return final
