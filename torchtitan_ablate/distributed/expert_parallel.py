"""Expert parallel (EP): routed experts split over the `ep` mesh, tokens moved by all-to-all.

The seam. `MoE.forward` hands its router's choices to `moe.experts.route(x_TD, experts_TK,
weights_TK, counts_E)`; the MoE layer itself is untouched. `apply_ep` turns each
`moe.experts` (a GroupedExperts) into an `ExpertParallelExperts` in place, by swapping its class
the way FSDP2's `fully_shard` does. So the module object, its hooks and its parameter names
`w1/w2/w3` stay the same (FSDP, DCP and the state-dict adapter find them unchanged); only its
weights (now DTensors, Shard(0) over ep: E/ep experts per rank, global shapes for checkpoints)
and its route and forward change:

    route     deduplicated dispatch (ep_dispatch.py): each token goes once to every rank that
              holds one of its experts, with its router weights; one host sync per layer
    forward   the local experts on the local weights (`DTensor.to_local()`), called by route
              as a module call (FSDP's hooks over efsdp wrap it)
    combine   the receiver sums the weighted expert outputs of each row, all-to-all back,
              each token sums its rows

Gradients: the trainer's loss on each rank is its local sum / the global token count and FSDP
sums gradients, so the expert gradient that the backward all-to-all delivers (the contributions
of every rank of the ep group, summed) is already the right one: nothing is divided here.

Shape legend: T tokens of this rank, K top_k, M (row, local expert) pairs it computes, D model
dim, I expert hidden dim, E global experts, W ep degree, L = E / W local experts.
"""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torchtitan_ablate.distributed.ep_dispatch import dedup_route
from torchtitan_ablate.models.common.experts import (
    GroupedExperts,
    _grouped_mm_experts,
    _loop_experts,
    use_grouped_mm,
)


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
    """GroupedExperts holding E / ep experts per rank: route = dispatch, compute, combine
    (ep_dispatch.py); forward = the local experts on rows sorted by local expert.

    Made only by `apply_ep` (class swap); `ep_mesh` is set there.
    """

    ep_mesh: DeviceMesh

    def route(
        self,
        x_TD: torch.Tensor,
        experts_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        counts_E: torch.Tensor,
    ) -> torch.Tensor:
        return dedup_route(self, x_TD, experts_TK, weights_TK, counts_E)

    def forward(self, x_MD: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        """x_MD: received rows sorted by local expert; counts_L: rows per local expert."""
        return self._local_experts(x_MD, counts_L)

    @torch.no_grad()
    def init_weights(self, init_std: float) -> None:
        # DTensor random ops would fill each shard from the local generator on CPU (every ep
        # rank gets the same experts) and from an offset-based tracker on CUDA (values unlike
        # the unsharded run). Instead every rank draws the global weights exactly as a plain
        # GroupedExperts does, from the same seeded stream, and keeps its part: EP changes no
        # initial weight. Cost: the three global expert tensors, transiently, on every rank.
        num_experts, hidden_dim, dim = self.w1.shape
        with torch.device(_local(self.w1).device):
            full = GroupedExperts(dim, hidden_dim, num_experts)
        full.init_weights(init_std)
        for name in ("w1", "w2", "w3"):
            w = getattr(self, name)
            # src_data_rank=None: every rank holds the global tensor, so slice without comms.
            full_w = getattr(full, name).data
            if not isinstance(w, DTensor):  # init_weights_unsharded swapped in a full tensor
                w.copy_(full_w)
                continue
            w.copy_(distribute_tensor(full_w, w.device_mesh, w.placements, src_data_rank=None))

    def _local_experts(self, x_MD: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        # The experts see only their own tokens, so they compute on the local shards; to_local()
        # is differentiable and hands the gradient back as a Shard(0) DTensor.
        w1_LID, w2_LDI, w3_LID = (_local(w) for w in (self.w1, self.w2, self.w3))
        grouped = self.force_grouped_mm
        if grouped is None:
            grouped = use_grouped_mm(x_MD)
        # The loop syncs again for its own splits: CPU / fp32 tests only, not the CUDA bf16 path.
        run = _grouped_mm_experts if grouped else _loop_experts
        return run(w1_LID, w2_LDI, w3_LID, x_MD, counts_L)


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w
