"""parallelize_qwen3: the one place where techniques are applied to a meta-device Qwen3Model.

The order is fixed and matters:
1. float8 first: later wrappers must see the final module types.
2. expert parallel: installs token dispatch/combine around the routed experts.
3. context parallel: wraps attention so it sees every key/value of the sharded sequence.
4. activation checkpointing: wraps whole blocks, so it goes after the modules inside them.
5. torch.compile per block: after AC (the checkpoint is compiled with the block) and before
   FSDP, so FSDP's hooks stay outside the compiled graphs.
6. FSDP2 / HSDP last: it shards whatever parameters the steps above left in place.
"""

import logging

import torch.nn as nn

from torchtitan_ablate.config.job_config import JobConfig
from torchtitan_ablate.distributed.parallel_dims import ParallelDims

logger = logging.getLogger("torchtitan_ablate")


class NotYetSupportedError(ValueError):
    """A technique whose code has not landed yet; rejected up front instead of ignored."""


def _not_yet(what: str) -> None:
    raise NotYetSupportedError(f"{what} is not implemented yet (see the parallelism issue)")


def parallelize_qwen3(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    if job_config.float8.enable:
        _not_yet("float8.enable = true")
    if parallel_dims.ep_enabled:
        _not_yet(f"parallelism.expert_parallel_degree = {parallel_dims.ep}")
    if parallel_dims.cp_enabled:
        _not_yet(f"parallelism.context_parallel_degree = {parallel_dims.cp}")
    if job_config.activation_checkpoint.mode != "none":
        _not_yet(f"activation_checkpoint.mode = {job_config.activation_checkpoint.mode!r}")
    if job_config.compile.enable and "model" in job_config.compile.components:
        _not_yet("compile.enable = true")
    if parallel_dims.dp > 1:
        _not_yet(f"data parallel degree {parallel_dims.dp} (FSDP2/HSDP)")
    return model
