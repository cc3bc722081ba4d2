"""The model-state floor: parameters, gradients and optimizer states per GPU, with no trace.

Whatever the batch, activation checkpointing or compile, rank 0 holds at the optimizer step its
shard of every parameter, of every trainable parameter's gradient and of Adam's two moments.
`model_state(config)` lists the parameters of the model built on the meta device (LoRA applied,
DPO's reference copy added), `state_floor(params, pd)` what one rank holds of them:

- storage dtype: the parameters' own (float32: FSDP's MixedPrecisionPolicy casts to bf16 only
  for compute); gradients and Adam's moments take the parameter's dtype;
- frozen parameters (LoRA's base, DPO's reference) have no gradient and no moments;
- FSDP / HSDP shard dim 0 over dp_shard * cp ranks (padded to a multiple of it) and replicate
  over dp_replicate; EP splits the routed experts' dim 0 over ep and FSDP shards the rest over
  efsdp = dp_shard * cp * tp / ep (the tp ranks share the experts, which TP leaves whole); TP
  first splits each other weight on the dim its plan names (`tp_shard_dim`: rows or columns;
  norms and the router whole);
- pipeline parallel: a rank holds only its parts' parameters; the floor is the pipeline rank
  that holds the most (`pipeline_floor`);
- each tensor is rounded up to the caching allocator's 512-byte blocks.
"""

import math
from dataclasses import dataclass, replace

import torch

from torchtitan_ablate.config import JobConfig
from torchtitan_ablate.config.dpo_config import dpo_enabled
from torchtitan_ablate.distributed.parallel_dims import ParallelDims
from torchtitan_ablate.distributed.pipeline_parallel import plan_stages, stage_ids
from torchtitan_ablate.distributed.tensor_parallel import tp_shard_dim
from torchtitan_ablate.estimator.cuda_model import ROUND_BYTES
from torchtitan_ablate.layout import build_model_args
from torchtitan_ablate.models.common.experts import GroupedExperts
from torchtitan_ablate.models.common.lora import apply_lora
from torchtitan_ablate.models.registry import get_spec

GIB = 1024**3
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, in the parameter's dtype (AdamW and Adam alike)


@dataclass(frozen=True)
class ParamShape:
    rows: int
    """dim 0, the one FSDP shards and EP splits."""
    row_bytes: int
    trainable: bool
    expert: bool
    """A routed experts' tensor: EP splits its rows."""
    unit: str = ""
    """The top-level module that holds it (tok_embeddings, layers.N, norm, output): the unit
    pipeline parallel places on a part."""
    tp_dim: int | None = None
    """The dim tensor parallel splits (0 rows, 1 columns), None if it stays whole."""


@dataclass(frozen=True)
class StateFloor:
    world_size: int
    parameters_gib: float
    gradients_gib: float
    optimizer_gib: float

    @property
    def total_gib(self) -> float:
        return self.parameters_gib + self.gradients_gib + self.optimizer_gib

    def describe(self) -> str:
        return (
            f"{self.total_gib:.2f} GiB per GPU at world size {self.world_size} (parameters "
            f"{self.parameters_gib:.2f}, gradients {self.gradients_gib:.2f}, optimizer states "
            f"{self.optimizer_gib:.2f})"
        )


def model_state(config: JobConfig) -> list[ParamShape]:
    """Every parameter the run holds, from the model built on the meta device."""
    args = build_model_args(config)
    with torch.device("meta"):
        model = get_spec(config.model.name).model_cls(args)
    lora = config.lora
    if lora.enable:
        apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.target_modules)
    params, seen = [], set()
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:  # tied embedding and output: one tensor
                continue
            seen.add(id(p))
            rows = p.shape[0] if p.dim() else 1
            row_bytes = p.numel() // max(rows, 1) * p.element_size()
            expert = isinstance(module, GroupedExperts)
            unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else name
            tp_dim = tp_shard_dim(name) if p.dim() == 2 else None
            params.append(ParamShape(rows, row_bytes, p.requires_grad, expert, unit, tp_dim))
    if dpo_enabled(config) and not lora.enable:  # the frozen reference copy, sharded alike
        params += [replace(p, trainable=False) for p in params]
    return params


def pipeline_floor(config: JobConfig, params: list[ParamShape], pd: ParallelDims) -> StateFloor:
    """The floor of the busiest pipeline rank (the only one without pipeline parallel)."""
    if not pd.pp_enabled:
        return state_floor(params, pd)
    p = config.parallelism
    fqns = plan_stages(p, build_model_args(config).n_layers)
    floors = []
    for rank in range(pd.pp):
        units = {name for i in stage_ids(p, rank, len(fqns)) for name in fqns[i]}
        floors.append(state_floor([q for q in params if q.unit in units], pd))
    return max(floors, key=lambda f: f.total_gib)


def state_floor(params: list[ParamShape], pd: ParallelDims) -> StateFloor:
    """What one rank holds of `params` in the layout `pd` (all of them on its parts)."""
    shard = pd.dp_shard * pd.cp
    weights = grads = steps = 0
    for p in params:
        rows, row_bytes = p.rows, p.row_bytes
        if pd.tp > 1 and p.tp_dim == 0:
            rows //= pd.tp
        elif pd.tp > 1 and p.tp_dim == 1:
            row_bytes //= pd.tp
        if p.expert and pd.experts_mesh_enabled:
            rows = math.ceil(rows // pd.ep / pd.efsdp)
        else:
            rows = math.ceil(rows / shard)
        nbytes = math.ceil(rows * row_bytes / ROUND_BYTES) * ROUND_BYTES
        weights += nbytes
        grads += nbytes if p.trainable else 0
        steps += ROUND_BYTES if p.trainable else 0  # Adam's step count, one scalar per tensor
    optimizer = ADAM_MOMENTS * grads + steps
    return StateFloor(pd.world_size, weights / GIB, grads / GIB, optimizer / GIB)
