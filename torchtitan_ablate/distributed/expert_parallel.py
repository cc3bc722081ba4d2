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
              (uneven splits), then permute the received rows from (source rank, local expert)
              order to (local expert, source rank) order
    compute   the local experts on the local weights (`DTensor.to_local()`)
    combine   undo the permutation, all-to-all back with the splits reversed

A deduplicated dispatch (each token sent once per destination rank, not once per expert, then
expanded and summed on the receiver) moves 2.2x fewer rows but ran 29% slower per step on 4 H200s
(docs/LOG.md, 2026-11-27): the receiver's expansion and sums cost more than the saved transfer.

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
    use_grouped_mm,
)
from torchtitan_ablate.models.common.permute import inverse_permutation, permute_rows


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shards every MoE block's routed experts over the 1-D `ep_mesh` and installs dispatch.

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
        experts.__class__ = ExpertParallelExperts
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
        plan = _plan_dispatch(num_tokens_per_expert_E, self.ep_mesh.size(), group, x_RD.shape[0])
        x_recv_ND = all_to_all_single_autograd(x_RD, plan.recv_splits, plan.send_splits, group)
        inv_perm_N = inverse_permutation(plan.perm_N)
        x_ND = permute_rows(x_recv_ND, plan.perm_N, inv_perm_N)  # grouped by local expert
        out_ND = self._local_experts(x_ND, plan.counts_L)
        out_recv_ND = permute_rows(out_ND, inv_perm_N, plan.perm_N)
        return all_to_all_single_autograd(out_recv_ND, plan.send_splits, plan.recv_splits, group)

    def _local_experts(self, x_ND: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        # The experts see only their own tokens, so they compute on the local shards; to_local()
        # is differentiable and hands the gradient back as a Shard(0) DTensor.
        w1_LID, w2_LDI, w3_LID = (_local(w) for w in (self.w1, self.w2, self.w3))
        grouped = self.force_grouped_mm
        if grouped is None:
            grouped = use_grouped_mm(x_ND)
        # The loop syncs again for its own splits: CPU / fp32 tests only, not the CUDA bf16 path.
        run = _grouped_mm_experts if grouped else _loop_experts
        return run(w1_LID, w2_LDI, w3_LID, x_ND, counts_L)


@dataclass
class _DispatchPlan:
    send_splits: list[int]  # [W] rows this rank sends to each ep rank
    recv_splits: list[int]  # [W] rows this rank receives from each ep rank
    counts_L: torch.Tensor  # [L] received rows per local expert (on the device)
    perm_N: torch.Tensor  # [N] received-row index of each row in local-expert order


def _plan_dispatch(
    counts_E: torch.Tensor, ep: int, group: ProcessGroup, n_rows: int
) -> _DispatchPlan:
    """Exchanges the counts and derives splits and the permutation; the only host sync of EP."""
    # Expert e lives on rank e // L, so row w of counts_WL goes to rank w (equal splits of L).
    counts_WL = counts_E.view(ep, -1)
    n_local = counts_WL.shape[1]
    # recv_WL[s, l]: rows that rank s sends for this rank's local expert l.
    recv_WL = all_to_all_single(counts_E, None, None, group).view(ep, n_local)
    # The one device->host sync EP needs: all-to-all with uneven splits takes host ints. Both
    # directions come over in a single copy; the backward reuses these splits without a sync.
    send_splits, recv_splits, recv_WL = count_reader().ep_splits(counts_WL.sum(1), recv_WL, n_rows)

    # Received rows come in blocks (s, l) in source-major order, each block in token order.
    # Key each row by its block's expert-major position l * W + s; a stable sort of the keys
    # groups the rows by local expert (then source) and keeps every block's row order.
    device = counts_E.device
    key_WL = torch.arange(n_local, device=device) * ep + torch.arange(ep, device=device)[:, None]
    key_N = torch.repeat_interleave(
        key_WL.flatten(), recv_WL.flatten(), output_size=sum(recv_splits)
    )
    perm_N = key_N.argsort(stable=True)
    return _DispatchPlan(send_splits, recv_splits, recv_WL.sum(0), perm_N)


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w
