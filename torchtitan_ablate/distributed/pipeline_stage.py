"""The pipeline stage as the schedules see it: every boundary's shapes given at build time (the
first step infers nothing) and the run's loss head added to the forward's keywords."""

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage

from torchtitan_ablate.models.common.output_head import LossHead


@dataclass
class ActivationMeta:
    """What crosses a stage boundary: token ids [mb, seq] into the first stage, hidden states
    [mb, seq / tp, dim] of `dtype` between stages, the scalar loss sum out of the last. seq is
    this rank's sequence: training.seq_len / context_parallel_degree (each cp rank's zigzag
    slice); tensor parallel's sequence parallel splits the hidden states again over its tp
    ranks (tensor_parallel._shard_stage_boundaries)."""

    microbatch_size: int
    seq_len: int
    dim: int
    dtype: torch.dtype
    tp: int = 1


class _StaticVote:
    """The result of torch's warm-up vote when every stage knows its shapes: the schedule reads
    it with `.item()` (1 = static). Not a tensor: under FakeTensorMode (the estimator) a
    tensor's value cannot be read on the host."""

    def item(self) -> int:
        return 1


class KnownShapesStage(PipelineStage):
    """A stage built with every boundary's shapes (`stage_meta`) and the run's loss head.

    torch (2.13) lets the stages vote at the first step on whether shapes must be inferred,
    passing a tensor from rank to rank and reading the result on the host; here every stage
    votes static, so the result is known without the exchange (older torch does not vote: the
    vote methods are never called). The loss head is added to the forward's keywords here, not
    passed with the micro-batch: torch 2.11's zero-bubble input backward takes every keyword
    of the micro-batch for a tensor."""

    def __init__(self, loss_head: LossHead, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loss_head = loss_head

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        return super().forward_maybe_with_nosync(*args, loss_head=self._loss_head, **kwargs)

    def _warmup_forward_vote(self, has_backward: bool, received_acc: Any = None) -> Any:
        return _StaticVote()

    def _warmup_backward_result(self, received_result: Any = None) -> Any:
        return _StaticVote()

    # torch's V-shaped schedules (ZBVZeroBubble) hand the gradient between a rank's two
    # adjacent stages even in eval, which has none: nothing to hand over there.
    def get_local_bwd_output(self, *args: Any, **kwargs: Any) -> Any:
        return super().get_local_bwd_output(*args, **kwargs) if self.has_backward else ()

    def set_local_bwd_input(self, *args: Any, **kwargs: Any) -> None:
        if self.has_backward:
            super().set_local_bwd_input(*args, **kwargs)


# What this torch's PipelineStage takes: 2.11 takes no gradient shapes (it derives them from
# the activations').
_STAGE_KWARGS = frozenset(inspect.signature(PipelineStage.__init__).parameters)


def stage_meta(i: int, stages: int, meta: ActivationMeta) -> dict:
    shape = (meta.microbatch_size, meta.seq_len // meta.tp, meta.dim)
    # Hidden states carry gradients back across the boundary: marked as needing them.
    hidden = torch.empty(shape, dtype=meta.dtype, device="meta", requires_grad=True)
    tokens = torch.empty(meta.microbatch_size, meta.seq_len, dtype=torch.long, device="meta")
    loss = torch.empty((), dtype=torch.float32, device="meta", requires_grad=True)
    first, last = i == 0, i == stages - 1
    meta_kwargs = {
        "input_args": tokens if first else hidden,
        "output_args": loss if last else hidden,
        # The gradients that cross the boundaries: none into the token ids or the loss.
        "input_grads": (None,) if first else hidden,
        "output_grads": (None,) if last else hidden,
    }
    return {k: v for k, v in meta_kwargs.items() if k in _STAGE_KWARGS}
