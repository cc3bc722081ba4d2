"""FSDP2 (fully_shard): embeddings, each block, norm + head, then the root; HSDP on a 2-D mesh.

The trainer's loss is a sum divided by the global valid-token count on every rank, so the
gradients must be *summed* across data-parallel ranks: FSDP's default averaging is turned off.
"""

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

# FSDP2's pluggable-collective interfaces (torch >= 2.9; not re-exported publicly).
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from torchtitan_ablate.config.job_config import Training

logger = logging.getLogger("torchtitan_ablate")


def param_dtype(training: Training, device_type: str) -> torch.dtype:
    """bf16 compute on GPU by default; CPU stays fp32 unless asked, for exact comparisons."""
    t = training
    if t.mixed_precision_param == "bfloat16" and (device_type == "cuda" or t.cpu_mixed_precision):
        return torch.bfloat16
    return torch.float32


def reshard_policy(mode: str, is_last_block: bool) -> bool:
    """ "never" keeps gathered parameters until backward (ZeRO-2-like memory, no re-gather);
    "default" skips resharding only the last block, whose backward starts right away."""
    if mode == "always":
        return True
    if mode == "never":
        return False
    return not is_last_block


@dataclass
class AccumulationPlan:
    """What FSDP does between the micro-batches of one optimizer step (made by apply_fsdp)."""

    gather_once: bool = False
    """Keep the gathered weights until the last backward (ZeRO-2 mode)."""
    sync_grads_once: bool = False
    """Accumulate unsharded gradients and reduce them after the last backward (one rank)."""


def before_micro_batch(
    model: nn.Module, plan: AccumulationPlan | None, index: int, count: int
) -> None:
    """Tell FSDP whether micro-batch `index` of `count` is the step's last (no-op without FSDP:
    plan None)."""
    if plan is None or count == 1:
        return
    last = index == count - 1
    if plan.gather_once:
        model.set_reshard_after_backward(last)
    if plan.sync_grads_once:
        model.set_requires_gradient_sync(last)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str,
    cpu_offload: bool = False,
    experts_mesh: DeviceMesh | None = None,
) -> AccumulationPlan:
    """Shards model in place. experts_mesh: the ranks left after EP for routed experts.
    Returns what `before_micro_batch` must tell FSDP between the micro-batches of a step."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs = dict(
        mesh=dp_mesh,
        mp_policy=mp,
        offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    )
    # A pipeline stage holds tok_embeddings or norm + output or neither (None).
    whole = model.output is not None and model.tok_embeddings is not None
    tied = whole and model.output.weight is model.tok_embeddings.weight
    if not tied and model.tok_embeddings is not None:
        # With tied weights the shared table must live in one FSDP group: the root's.
        reshard = reshard_policy(reshard_after_forward, is_last_block=False)
        fully_shard(model.tok_embeddings, reshard_after_forward=reshard, **kwargs)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        reshard = reshard_policy(reshard_after_forward, i == len(blocks) - 1)
        moe = getattr(block, "moe", None)
        if experts_mesh is not None and moe is not None:
            # Experts are already split over ep; shard what is left over efsdp (tp ranks
            # included) on their own mesh, so their gradients are reduced over exactly the
            # ranks holding copies.
            fully_shard(
                moe.experts, **{**kwargs, "mesh": experts_mesh}, reshard_after_forward=reshard
            )
            if _shard_size(experts_mesh) == 1:
                moe.experts.set_custom_all_gather(OneRankAllGather())
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    if not tied and model.output is not None:
        fully_shard([model.norm, model.output], reshard_after_forward=False, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    if experts_mesh is not None:
        _prefetch_explicitly(model, blocks, tied)
    # "never" holds every block's gathered weights at the end of each forward anyway, so keeping
    # them across the micro-batches of a step costs no peak memory and saves the re-gathers.
    # On one rank the reduce-scatter is a copy and the unsharded gradients are as large as the
    # sharded ones, so accumulating micro-batches unsharded in the fp32 reduce dtype (FSDP's
    # no-sync mode) costs no memory, adds in the same order, and skips three gradient copies
    # per micro-batch (~30 ms per 3.2B parameters on an H100). With more ranks it would hold
    # full-size gradients: not done there.
    one_rank = dp_mesh.size() == 1 and (experts_mesh is None or experts_mesh.size() == 1)
    plan = AccumulationPlan(
        gather_once=reshard_after_forward == "never",
        sync_grads_once=one_rank and reduce_dtype == torch.float32 and not cpu_offload,
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Plain SUM collectives (also NCCL's zero-copy path); gloo has no PREMUL_SUM.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            if one_rank:
                module.set_custom_all_gather(OneRankAllGather())
                module.set_custom_reduce_scatter(OneRankReduceScatter())
    return plan


def _prefetch_explicitly(model: nn.Module, blocks: list[nn.Module], tied: bool) -> None:
    """Each FSDP group starts the next one's all-gather (the previous one's in backward).

    FSDP's implicit prefetch issues a block's all-gather when the CPU reaches that block, which
    overlaps compute only while the CPU runs ahead of the GPU. Expert parallel's dispatch waits
    for the GPU once per MoE layer (its split sizes), so the CPU never gets ahead and every
    all-gather would start late and sit exposed; issued one group early it overlaps the current
    group's compute, at the cost of holding one more group's gathered weights. A pipeline part
    chains only the groups it holds (its embedding, head or blocks may be absent)."""

    def group(block: nn.Module) -> list[nn.Module]:
        moe = getattr(block, "moe", None)
        return [block] + ([moe.experts] if moe is not None else [])

    # (module whose hooks prefetch, the FSDP modules of its group) in forward order.
    units = [(block, group(block)) for block in blocks]
    if not tied and model.tok_embeddings is not None:
        units.insert(0, (model.tok_embeddings, [model.tok_embeddings]))
    if not tied and model.output is not None:
        units.append((model.output, [model.norm, model.output]))
    for (module, _), (_, nxt) in zip(units, units[1:]):
        module.set_modules_to_forward_prefetch(nxt)
    for (module, _), (_, prev) in zip(units[1:], units):
        module.set_modules_to_backward_prefetch(prev)


def _shard_size(mesh: DeviceMesh) -> int:
    """Ranks of FSDP's shard group on `mesh` (its last dimension; HSDP's first replicates)."""
    return mesh.size(mesh.ndim - 1)


class OneRankAllGather(AllGather):
    """FSDP's parameter all-gather over a shard group of one rank: nothing to move.

    FSDP copies (and casts to the compute dtype) each sharded parameter into this rank's slice
    of the all-gather output before the collective; with one rank that slice is the whole
    buffer, so the collective would copy the buffer onto itself. NCCL does so with its
    low-latency protocol: 28 ms per step for the experts of 8 layers of Qwen3-30B-A3B at EP 4
    on 4 H200s, where each rank holds its experts whole (docs/performance.md)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if input_tensor.data_ptr() != output_tensor.data_ptr():
            output_tensor.copy_(input_tensor)  # not FSDP's in-place layout: gather by copying
        return None


class OneRankReduceScatter(ReduceScatter):
    """FSDP's gradient reduction on one rank: a copy, into buffers from the training
    stream's memory pool.

    FSDP allocates the reduced gradients (which become the fp32 sharded `.grad`s) on its
    reduce-scatter stream, and the caching allocator keeps each stream's freed blocks for
    that stream only. On one GPU near its memory limit (the one-GPU MoE: 12.8 GB of fp32
    gradients) the training stream and FSDP's stream then take turns freeing each other's
    cached blocks: two allocator retries and ~40 cudaFree per step, each a device sync
    (docs/performance.md). Safe: FSDP's stream waits for the training stream before it
    writes, and the training stream waits for FSDP's before it reads or frees the grads.
    """

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return torch.empty(*size, dtype=dtype, device=device)
        with torch.cuda.stream(torch.cuda.default_stream(device)):
            return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        output_tensor.copy_(input_tensor)  # one rank: nothing to reduce
        return None


def describe_layout(dp_replicate: int, dp_shard: int) -> str:
    if dp_shard == 1 and dp_replicate > 1:
        return (
            f"data parallel: replicate-only over {dp_replicate} ranks via FSDP2 on a "
            f"(replicate={dp_replicate}, shard=1) mesh (DDP semantics: full parameters on "
            "every rank, gradients all-reduced)"
        )
    if dp_replicate > 1:
        return f"data parallel: HSDP, {dp_replicate} replicas x {dp_shard} shards"
    return f"data parallel: FSDP over {dp_shard} ranks"
