"""What a run is before anything is built: the degrees, the model's sizes, the micro-batches of
a step, and every check that needs no process group (`check_layout`: the trainer's, the
estimator's and the ablation dry run's). build.py builds on it.
"""

from dataclasses import dataclass
from typing import Any

from torchtitan_ablate.config import ConfigError, JobConfig
from torchtitan_ablate.distributed.parallel_dims import ParallelDims
from torchtitan_ablate.distributed.pipeline_parallel import check_pipeline
from torchtitan_ablate.models.registry import get_spec


@dataclass
class Layout:
    """What a run is before anything is built: degrees, model sizes, micro-batches per step."""

    parallel_dims: ParallelDims
    model_args: Any
    """The sizes, in the model family's args class."""
    grad_accum: int
    sequences_per_step: int
    """Sequences per optimizer step over all ranks (the global batch)."""


def build_parallel_dims(config: JobConfig, world_size: int) -> ParallelDims:
    p = config.parallelism
    try:
        return ParallelDims(
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree,
            ep=p.expert_parallel_degree,
            world_size=world_size,
            tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def num_microbatches(config: JobConfig, dp: int) -> int:
    t = config.training
    per_micro = t.local_batch_size * dp
    if t.global_batch_size == -1:
        return 1
    if t.global_batch_size % per_micro:
        raise ConfigError(
            f"training.global_batch_size = {t.global_batch_size} must be a multiple of "
            f"local_batch_size * data-parallel degree = {t.local_batch_size} * {dp}"
        )
    return t.global_batch_size // per_micro


def build_model_args(config: JobConfig) -> Any:
    """The model's sizes, in its family's args class (no world size needed)."""
    m = config.model
    return get_spec(m.name).build_args(
        m,
        config.training.seq_len,
        config.checkpoint.initial_load_path,
        config.debug.moe_force_load_balance,
    )


def check_layout(config: JobConfig, world_size: int) -> Layout:
    """Every check made before anything is built (shared by the trainer, the estimator and the
    ablation dry run): degrees vs world size, model vs degrees, batch vs data parallel."""
    pd = build_parallel_dims(config, world_size)
    spec = get_spec(config.model.name)
    model_args = build_model_args(config)
    if pd.tp_enabled and spec.tp_split is None:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree = {pd.tp}: model.name = {config.model.name!r} "
            "has no tensor parallel; set it to 1"
        )
    tp_split = spec.tp_split(model_args) if spec.tp_split is not None else None
    try:
        pd.check_model(model_args.num_experts, config.training.seq_len, tp_split)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if pd.pp_enabled:
        check_pipeline(config, model_args)
    grad_accum = num_microbatches(config, pd.dp)
    sequences = config.training.local_batch_size * pd.dp * grad_accum
    return Layout(pd, model_args, grad_accum, sequences)
