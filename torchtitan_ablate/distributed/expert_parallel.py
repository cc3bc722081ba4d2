"""Expert parallel (EP): routed experts split over the `ep` mesh, tokens moved by all-to-all.

The seam. `MoE.forward` hands its router's choices to `moe.experts.route(x_TD, experts_TK,
weights_TK, counts_E)`; the MoE layer itself is untouched. `apply_ep` turns each
`moe.experts` (a GroupedExperts) into an `ExpertParallelExperts` in place, by swapping its class
the way FSDP2's `fully_shard` does. So the module object, its hooks and its parameter names
`w1/w2/w3` stay the same (FSDP, DCP and the state-dict adapter find them unchanged); only its
weights (now DTensors, Shard(0) over ep: E/ep experts per rank, global shapes for checkpoints)
and its forward change. GroupedExperts.route sorts the (token, k) rows by global expert and
calls forward, which here is:

    dispatch  all-to-all of the per-expert counts, one host sync for the split sizes (read
              through experts.py's CountReader, the estimator's seam), all-to-all of the rows
              (uneven splits); the received rows come in (source rank, local expert) order
    compute   the local experts on the local weights (`DTensor.to_local()`), each received
              row scattered straight into its expert's padded group and gathered back from it
              (one move each way, no separate permutation to expert order)
    combine   all-to-all back with the splits reversed

Token dispatch (ep_token_dispatch.py, `parallelism.expert_parallel_dispatch = "tokens"`) sends
each token once per destination rank instead and sums on the receiver: 2.2x fewer rows at top-8
of 128 over 4 ranks. A first version of it ran 29% slower per step on 4 H200s (docs/LOG.md,
2026-11-27), its expansions and sums costing more than the saved transfer; the current one moves
rows in single passes like this file.

Gradients: the trainer's loss on each rank is its local sum / the global token count and FSDP
sums gradients, so the expert gradient that the backward all-to-all delivers (the contributions
of every rank of the ep group, summed) is already the right one: nothing is divided here.

Shape legend: R rows this rank routes (sorted by global expert), N rows it receives, D model
dim, I expert hidden dim, E global experts, W ep degree, L = E / W local experts.
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed._functional_collectives import (
    all_to_all_single,
    all_to_all_single_autograd,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torchtitan_ablate.models.common.experts import (
    GroupedExperts,
    _grouped_mm_experts,
    _loop_experts,
    count_reader,
)


def apply_ep(
    model: nn.Module,
    ep_mesh: DeviceMesh,
    experts_class: "type[ExpertParallelExperts] | None" = None,
) -> None:
    """Shards every MoE block's routed experts over the 1-D `ep_mesh` and installs dispatch:
    `experts_class` (default ExpertParallelExperts, row dispatch; ep_token_dispatch.py's
    TokenDispatchExperts sends each token once per rank).

    Runs before AC / compile / FSDP, on the meta-device model (or a real one: every rank must
    then hold the same weights, since the shards are scattered from rank 0).
    """
    if ep_mesh.ndim != 1:
        raise ValueError(f"apply_ep needs a 1-D ep mesh, got {ep_mesh.ndim}-D {ep_mesh}")
    ep = ep_mesh.size()
    for layer_id, block in model.layers.items():
        moe = getattr(block, "moe", None)
        if moe is None:
            continue
        experts = moe.experts
        if isinstance(experts, ExpertParallelExperts):
            raise ValueError(f"apply_ep: layer {layer_id} already has expert parallel applied")
        # ParallelDims.check_model rejected such a layout before the model was built.
        assert experts.num_experts % ep == 0, f"layer {layer_id}: {experts.num_experts} % {ep}"
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        experts.__class__ = experts_class or ExpertParallelExperts
        experts.ep_mesh = ep_mesh


class ExpertParallelExperts(GroupedExperts):
    """GroupedExperts holding E / ep experts per rank; forward = dispatch, compute, combine.

    Made only by `apply_ep` (class swap); `ep_mesh` is set there.
    """

    ep_mesh: DeviceMesh

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """x_RD: this rank's routed rows sorted by global expert (GroupedExperts.route sorts
        them); num_tokens_per_expert_E: this rank's counts."""
        group = self.ep_mesh.get_group()
        splits = _exchange_counts(
            num_tokens_per_expert_E, self.ep_mesh.size(), group, x_RD.shape[0]
        )
        x_recv_ND = all_to_all_single_autograd(x_RD, splits.recv_splits, splits.send_splits, group)
        # Queued after the all-to-all, which waits only for the work before it: the rows travel
        # while these small kernels run.
        rank_N = _rank_in_expert_order(splits.recv_WL, sum(splits.recv_splits))
        out_recv_ND = self._local_experts(x_recv_ND, splits.recv_WL.sum(0), rank_N)
        return all_to_all_single_autograd(
            out_recv_ND, splits.send_splits, splits.recv_splits, group
        )

    def _local_experts(
        self, x_ND: torch.Tensor, counts_L: torch.Tensor, rank_N: torch.Tensor
    ) -> torch.Tensor:
        # The experts see only their own tokens, so they compute on the local shards; to_local()
        # is differentiable and hands the gradient back as a Shard(0) DTensor.
        w1_LID, w2_LDI, w3_LID = (_local(w) for w in (self.w1, self.w2, self.w3))
        # The loop syncs again for its own splits: CPU / fp32 tests only, not the CUDA bf16 path.
        run = _grouped_mm_experts if self.runs_grouped_mm(x_ND) else _loop_experts
        return run(w1_LID, w2_LDI, w3_LID, x_ND, counts_L, rank_N)


@dataclass
class _Splits:
    send_splits: list[int]  # [W] rows this rank sends to each ep rank
    recv_splits: list[int]  # [W] rows this rank receives from each ep rank
    recv_WL: torch.Tensor  # [W, L] rows from source rank w for local expert l (on the device)


def _exchange_counts(counts_E: torch.Tensor, ep: int, group: ProcessGroup, n_rows: int) -> _Splits:
    """Exchanges the counts and reads the split sizes: the only host sync of EP."""
    # Expert e lives on rank e // L, so row w of counts_WL goes to rank w (equal splits of L).
    counts_WL = counts_E.view(ep, -1)
    # recv_WL[s, l]: rows that rank s sends for this rank's local expert l.
    recv_WL = all_to_all_single(counts_E, None, None, group).view(ep, -1)
    # The one device->host sync EP needs: all-to-all with uneven splits takes host ints. Both
    # directions come over in a single copy; the backward reuses these splits without a sync.
    send, recv, recv_WL = count_reader().ep_splits(counts_WL.sum(1), recv_WL, n_rows)
    return _Splits(send, recv, recv_WL)


def _rank_in_expert_order(recv_WL: torch.Tensor, n_recv: int) -> torch.Tensor:
    """[N] position of each received row in (local expert, source rank) order.

    Received rows come in blocks (s, l) in source-major order, each block in token order; a
    block keeps its row order and moves by the difference between its expert-major and its
    source-major start, so no sort is needed."""
    counts_B = recv_WL.flatten()
    source_major_B = counts_B.cumsum(0) - counts_B
    counts_LW = recv_WL.t()
    expert_major_B = (counts_LW.flatten().cumsum(0) - counts_LW.flatten()).view_as(counts_LW)
    shift_B = expert_major_B.t().flatten() - source_major_B
    row_N = torch.arange(n_recv, device=recv_WL.device)
    return row_N + torch.repeat_interleave(shift_B, counts_B, output_size=n_recv)


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w
