"""Pipeline parallel (PP) for Qwen3 through torch.distributed.pipelining, over the `pp` mesh.

Stages: the model, built whole on the meta device, is cut into stages (`split_stages`). Each
stage is a copy of the model that keeps its own blocks, plus tok_embeddings (first stage) or
norm and output (last stage); the other modules are deleted or set to None, so every parameter
keeps the name it has in the whole model: weights are drawn alike (models/common/init.py) and
checkpoints reshard by name between PP and any other layout. A rank holds one stage (1F1B,
GPipe) or several, virtual stages: rank r holds stages r, r + pp, ... (looped: Interleaved1F1B,
InterleavedZeroBubble) or r and 2 pp - 1 - r (V-shaped: ZBVZeroBubble).

Default split (`default_fqns`, torchtitan's rule): the embedding and the final norm + output
head each weigh one block; the n_layers + 2 units are dealt out evenly and the first stages
take one more unit each where the count does not divide.

Loss: every stage's forward gets the micro-batch's positions, document ids, labels and the
run's loss head as keywords; the last stage's output head returns the cross-entropy sum, and
the schedule's loss function divides it by the step's global count of valid tokens, as
step.train_step does, so the loss and the gradients equal the one-process run's (scale_grads
False: no extra mean over micro-batches). Validation runs the schedule's eval (forward only,
torchtitan's way) with that count 1: the sum itself, shared by the pp ranks (`pipeline_loss_sum`).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    ScheduleZBVZeroBubble,
    _PipelineSchedule,
    get_schedule_class,
)

from torchtitan_ablate.config import ConfigError, JobConfig
from torchtitan_ablate.config.parallelism_config import Parallelism
from torchtitan_ablate.config.pipeline_rules import SPLIT_BACKWARD
from torchtitan_ablate.distributed import utils as dist_utils
from torchtitan_ablate.distributed.pipeline_stage import (
    ActivationMeta,
    KnownShapesStage,
    stage_meta,
)
from torchtitan_ablate.models.common.output_head import LossHead


def num_stages(p: Parallelism, n_layers: int) -> int:
    """Stages over all ranks: the given split's, else from layers per stage, else 1 per rank
    (single-stage schedules) or 2 (the others)."""
    if p.module_fqns_per_model_part is not None:
        return len(p.module_fqns_per_model_part)
    if p.pipeline_parallel_layers_per_stage is not None:
        return -(-(n_layers + 2) // p.pipeline_parallel_layers_per_stage)
    single = issubclass(get_schedule_class(p.pipeline_parallel_schedule), PipelineScheduleSingle)
    return p.pipeline_parallel_degree * (1 if single else 2)


def default_fqns(stages: int, n_layers: int) -> list[list[str]]:
    """Module names per stage: n_layers + 2 units (embedding, blocks, norm + head) dealt out
    evenly, the first `units % stages` stages one unit more."""
    units = n_layers + 2
    if stages > units:
        raise ValueError(
            f"{stages} pipeline stages for {n_layers} blocks + embedding + head: too many; "
            "raise parallelism.pipeline_parallel_layers_per_stage"
        )
    per, extra = divmod(units, stages)
    fqns, layer = [], 0
    for s in range(stages):
        take = per + (s < extra) - (s == 0) - (s == stages - 1)
        names = ["tok_embeddings"] if s == 0 else []
        names += [f"layers.{i}" for i in range(layer, layer + take)]
        layer += take
        fqns.append(names + (["norm", "output"] if s == stages - 1 else []))
    return fqns


def plan_stages(p: Parallelism, n_layers: int) -> list[list[str]]:
    """The module names of every stage, checked against the model and the schedule; a
    ValueError names the key to change (build.check_layout reports it before any build)."""
    pp, schedule = p.pipeline_parallel_degree, p.pipeline_parallel_schedule
    stages = num_stages(p, n_layers)
    per_rank, rest = divmod(stages, pp)
    single = issubclass(get_schedule_class(schedule), PipelineScheduleSingle)
    key = "parallelism.pipeline_parallel_layers_per_stage or module_fqns_per_model_part"
    if rest or (single and per_rank != 1) or (not single and per_rank < 2):
        want = "1 stage per rank" if single else "2 or more stages per rank"
        raise ValueError(
            f"{stages} pipeline stages over parallelism.pipeline_parallel_degree = {pp} ranks: "
            f"parallelism.pipeline_parallel_schedule = {schedule!r} needs {want}; change {key}"
        )
    if schedule == "ZBVZeroBubble" and per_rank != 2:
        raise ValueError(
            "parallelism.pipeline_parallel_schedule = 'ZBVZeroBubble' needs 2 stages per rank, "
            f"not {per_rank}; change {key}"
        )
    fqns = p.module_fqns_per_model_part or default_fqns(stages, n_layers)
    blocks = [f"layers.{i}" for i in range(n_layers)]
    listed = [n for names in fqns for n in names]
    ok = (
        sorted(listed) == sorted(["tok_embeddings", "norm", "output"] + blocks)
        and "tok_embeddings" in fqns[0]
        and {"norm", "output"} <= set(fqns[-1])
        and [n for n in listed if n.startswith("layers.")] == blocks
    )
    if not ok:
        raise ValueError(
            "parallelism.module_fqns_per_model_part must list tok_embeddings first, layers.0 "
            f"to layers.{n_layers - 1} once each in order, and norm, output in the last stage"
        )
    return fqns


def check_pipeline(config: JobConfig, model_args: Any) -> None:
    """What pipeline parallel needs of the model (build.check_layout calls it before any
    build): untied embeddings, a feasible split, and under LoRA a block on every rank."""
    pp = config.parallelism.pipeline_parallel_degree
    if model_args.tie_embeddings:
        raise ConfigError(
            f"parallelism.pipeline_parallel_degree = {pp}: model.flavor = "
            f"{config.model.flavor!r} ties the embedding and output weights, which pipeline "
            "parallel puts on different stages; not supported yet (flavors 8B and larger are "
            "untied)"
        )
    p = config.parallelism
    schedule = p.pipeline_parallel_schedule
    if schedule in SPLIT_BACKWARD and _torch_version() < (2, 13):
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule = {schedule!r} needs torch 2.13 or newer "
            f"(this is {torch.__version__}: its weight-gradient pass fails on custom autograd "
            "functions, which the loss and the MoE aux loss are); use 1F1B or Interleaved1F1B"
        )
    try:
        fqns = plan_stages(p, model_args.n_layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    stages = len(fqns)
    for rank in range(pp) if config.lora.enable else ():
        # LoRA trains adapters on blocks only: a rank without one would have nothing to train.
        names = [n for i in stage_ids(p, rank, stages) for n in fqns[i]]
        if not any(n.startswith("layers.") for n in names):
            raise ConfigError(
                f"lora.enable = true with parallelism.pipeline_parallel_degree = {pp}: pipeline "
                f"rank {rank} holds no transformer block ({', '.join(names)}), so no adapter "
                "to train; change parallelism.pipeline_parallel_layers_per_stage or "
                "module_fqns_per_model_part"
            )
    n_micro = num_microbatches(p, config.training.local_batch_size)
    if schedule == "1F1B" and n_micro < stages:
        # torch's 1F1B fills the pipeline before its first backward: one micro-batch per part.
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule = '1F1B' over {stages} parts needs at "
            f"least {stages} micro-batches per loader batch, not {n_micro} "
            f"(training.local_batch_size {config.training.local_batch_size} / "
            f"pipeline_parallel_microbatch_size {p.pipeline_parallel_microbatch_size}): raise "
            "the batch, lower the micro-batch size, or use GPipe"
        )


def num_microbatches(p: Parallelism, local_batch_size: int) -> int:
    """Pipeline micro-batches per loader batch (the config rules made the size divide it)."""
    return local_batch_size // p.pipeline_parallel_microbatch_size


def theoretical_bubble(
    schedule: str, pp: int, num_microbatches: int, stages_per_rank: int
) -> float | None:
    """The share of a step a pipeline rank idles in the ideal schedule, every stage taking the
    same time per micro-batch (p ranks, m micro-batches, v stages per rank):

    - GPipe, 1F1B: (p - 1) / (m + p - 1) (Narayanan et al. 2021, "Efficient Large-Scale
      Language Model Training on GPU Clusters Using Megatron-LM", bubble (p - 1) / m of the
      compute);
    - Interleaved1F1B: (p - 1) / (v m + p - 1) (same paper: the bubble divided by v);
    - ZBVZeroBubble: 0 when m >= 2p, with equal forward, input-backward and weight-backward
      times (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6); None below;
    - InterleavedZeroBubble (torch's looped ZB1P): None, no published figure for v > 1.
    """
    p, m, v = pp, num_microbatches, stages_per_rank
    if schedule in ("GPipe", "1F1B", "Interleaved1F1B"):
        return (p - 1) / (v * m + p - 1)  # v = 1 for the single-stage schedules
    if schedule == "ZBVZeroBubble" and m >= 2 * p:
        return 0.0
    return None


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def stage_ids(p: Parallelism, pp_rank: int, stages: int) -> list[int]:
    """The stages rank `pp_rank` runs, in schedule order (looped or V-shaped)."""
    pp = p.pipeline_parallel_degree
    if get_schedule_class(p.pipeline_parallel_schedule) is ScheduleZBVZeroBubble:
        return [pp_rank, stages - 1 - pp_rank]
    return list(range(pp_rank, stages, pp))


def split_stages(model: nn.Module, fqns: list[list[str]], ids: list[int]) -> list[nn.Module]:
    """This rank's stages: copies of the (meta, not yet parallelized) model that keep only their
    own modules."""
    parts = []
    for i in ids:
        # Built afresh on meta, not deep-copied: a copy made under FakeTensorMode (the
        # estimator) holds fake parameters that to_empty cannot swap.
        with torch.device("meta"):
            part = type(model)(model.args)
        keep = set(fqns[i])
        for name in list(part.layers):
            if f"layers.{name}" not in keep:
                del part.layers[name]
        for name in ("tok_embeddings", "norm", "output"):
            if name not in keep:
                setattr(part, name, None)
        parts.append(part)
    return parts


class _ScaledLoss:
    """The schedule's loss: the last stage's cross-entropy sum over the step's global count of
    valid tokens (set before each step)."""

    def __init__(self) -> None:
        self.count: torch.Tensor | None = None

    def __call__(self, loss_sum: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_sum / self.count


@dataclass
class Pipeline:
    """What the train step needs to run this rank's stages."""

    schedule: _PipelineSchedule
    loss: _ScaledLoss
    has_first: bool
    has_last: bool
    pp_mesh: DeviceMesh
    n_microbatches: int
    """Micro-batches per loader batch: forwards of each stage per batch."""
    microbatch_size: int
    """Sequences per micro-batch (the stages' shapes)."""
    schedule_name: str
    """parallelism.pipeline_parallel_schedule."""
    stages_per_rank: int
    """Stages this rank runs (several: virtual stages)."""

    def layout(self) -> dict[str, Any]:
        """The schedule's shape and its theoretical bubble (metrics.comm_profile's record)."""
        pp, m, v = self.pp_mesh.size(), self.n_microbatches, self.stages_per_rank
        bubble = theoretical_bubble(self.schedule_name, pp, m, v)
        shape = {"schedule": self.schedule_name, "degree": pp, "microbatches": m}
        return shape | {"stages_per_rank": v, "theoretical_bubble": bubble}


def build_pipeline(
    parts: list[nn.Module],
    p: Parallelism,
    n_layers: int,
    local_batch_size: int,
    pp_mesh: DeviceMesh,
    device: torch.device,
    loss_head: LossHead,
    meta: ActivationMeta,
) -> Pipeline:
    """The schedule over this rank's (parallelized, materialized) stages. meta: the
    micro-batches' shapes, given to the stages so they infer nothing at the first step: an
    inference forward would enter MoE routing into the expert load, and a fake-tensor run (the
    estimator) cannot exchange shapes."""
    stages = num_stages(p, n_layers)
    ids = stage_ids(p, pp_mesh.get_local_rank(), stages)
    group = pp_mesh.get_group()
    pipeline_stages = [
        KnownShapesStage(
            loss_head, part, i, stages, device, group=group, **stage_meta(i, stages, meta)
        )
        for part, i in zip(parts, ids)
    ]
    cls = get_schedule_class(p.pipeline_parallel_schedule)
    loss = _ScaledLoss()
    n_micro = num_microbatches(p, local_batch_size)
    single = issubclass(cls, PipelineScheduleSingle)
    schedule = cls(
        pipeline_stages[0] if single else pipeline_stages,
        n_microbatches=n_micro,
        loss_fn=loss,
        scale_grads=False,
    )
    mb = p.pipeline_parallel_microbatch_size
    first, last, name = 0 in ids, stages - 1 in ids, p.pipeline_parallel_schedule
    return Pipeline(schedule, loss, first, last, pp_mesh, n_micro, mb, name, len(ids))


def pipeline_forward_backward(pipe: Pipeline, batch: dict, count: torch.Tensor) -> torch.Tensor:
    """Forward and backward of one loader batch through the pipeline; returns its loss (sum of
    its micro-batches' cross-entropy sums over `count`) on every pp rank."""
    pipe.loss.count = count
    return _run_schedule(pipe.schedule.step, pipe, batch)


def pipeline_loss_sum(pipe: Pipeline, batch: dict) -> torch.Tensor:
    """The cross-entropy sum of `batch` (a whole number of loader batches: the stages know one's
    shapes) through the schedule's eval, forward only, on every pp rank (validation)."""
    pipe.loss.count = torch.ones((), device=batch["input_ids"].device)  # the sums themselves
    rows = pipe.n_microbatches * pipe.microbatch_size
    chunks = [
        {k: v[i : i + rows] for k, v in batch.items()}
        for i in range(0, len(batch["input_ids"]), rows)
    ]
    return sum(_run_schedule(pipe.schedule.eval, pipe, chunk) for chunk in chunks)


def _run_schedule(run: Callable, pipe: Pipeline, batch: dict) -> torch.Tensor:
    """One schedule call (step or eval) over a loader batch; the sum of its micro-batches'
    losses, on every pp rank."""
    kwargs = {
        "positions_BS": batch["positions"],
        "document_ids_BS": batch["document_ids"],
        "labels_BS": batch["labels"],
    }
    args = (batch["input_ids"],) if pipe.has_first else ()
    losses: list[torch.Tensor] = []
    target = batch["labels"] if pipe.has_last else None
    # return_outputs False: the last stage's outputs are scalars, which cannot be concatenated.
    run(*args, target=target, losses=losses, return_outputs=False, **kwargs)
    device = batch["input_ids"].device
    total = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=device)
    # Only the last stage has the loss: the others hold 0, so a sum gives it to every rank.
    return dist_utils.all_reduce_sum(total, pipe.pp_mesh.get_group())
