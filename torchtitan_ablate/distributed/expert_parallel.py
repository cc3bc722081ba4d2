"""Expert parallel (EP): routed experts split over the `ep` mesh, tokens moved by all-to-all.

`apply_ep(model, ep_mesh, dispatch)` does two things to every `moe.experts` (a GroupedExperts),
the module object itself staying the same:
- shards its parameters with `distribute_module`: every direct parameter (w1/w2/w3 and, with
  LoRA, the adapters lora_a_w1, ...) becomes a DTensor, Shard(0) over ep: E / ep experts per
  rank, global shapes for checkpoints; FSDP, DCP and the state-dict adapter find the same names;
- installs `dispatch(ep_mesh)` as its dispatcher (the `dispatch` seam of experts.py): what moves
  the routed rows between ranks. The compute, `experts(x_XD, groups)`, is unchanged: it runs on
  the local shards of whatever weights the module holds (plain, float8, with adapters), so every
  dispatcher works with every compute.

Dispatchers: `RowDispatch` (here, the default) and `TokenDispatch` (ep_token_dispatch.py,
`parallelism.expert_parallel_dispatch = "tokens"`); a new one is one file beside them.

Row dispatch keeps LocalDispatch's sort of the (token, k) rows by global expert and its weighted
combine, and between them:

    dispatch  all-to-all of the per-expert counts, one host sync for the split sizes (read
              through experts.py's CountReader, the estimator's seam), all-to-all of the rows
              (uneven splits); the received rows come in (source rank, local expert) order
    compute   each received row scattered straight into its expert's group and gathered back
              from it (one move each way, no separate permutation to expert order)
    combine   all-to-all back with the splits reversed

Gradients: the trainer's loss on each rank is its local sum / the global token count and FSDP
sums gradients, so the expert gradient that the backward all-to-all delivers (the contributions
of every rank of the ep group, summed) is already the right one: nothing is divided here.

Shape legend: R rows this rank routes (sorted by global expert), N rows it receives, D model
dim, E global experts, W ep degree, L = E / W local experts.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed._functional_collectives import (
    all_to_all_single,
    all_to_all_single_autograd,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor

from torchtitan_ablate.models.common.experts import (
    Dispatch,
    GroupedExperts,
    LocalDispatch,
    count_reader,
)


class RowDispatch(LocalDispatch):
    """Each (token, k) row goes to the ep rank holding its expert and comes back from it."""

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        self.ep_mesh = ep_mesh

    def run_sorted(
        self, experts: GroupedExperts, x_RD: torch.Tensor, counts_E: torch.Tensor
    ) -> torch.Tensor:
        """x_RD: this rank's routed rows sorted by global expert; counts_E: this rank's counts."""
        group = self.ep_mesh.get_group()
        splits = _exchange_counts(counts_E, self.ep_mesh.size(), group, x_RD.shape[0])
        x_recv_ND = all_to_all_single_autograd(x_RD, splits.recv_splits, splits.send_splits, group)
        # Queued after the all-to-all, which waits only for the work before it: the rows travel
        # while these small kernels run.
        rank_N = rank_in_expert_order(splits.recv_WL, sum(splits.recv_splits))
        out_recv_ND = experts.run_rows(x_recv_ND, splits.recv_WL.sum(0), rank_N)
        return all_to_all_single_autograd(
            out_recv_ND, splits.send_splits, splits.recv_splits, group
        )


def apply_ep(
    model: nn.Module,
    ep_mesh: DeviceMesh,
    dispatch: Callable[[DeviceMesh], Dispatch] = RowDispatch,
) -> None:
    """Shards every MoE block's routed experts over the 1-D `ep_mesh` and installs
    `dispatch(ep_mesh)` (RowDispatch, or ep_token_dispatch.py's TokenDispatch) as their
    dispatcher.

    Runs after LoRA (its adapters are sharded with the weights) and before AC / compile / FSDP,
    on the meta-device model (or a real one: every rank must then hold the same weights, since
    the shards are scattered from rank 0).
    """
    if ep_mesh.ndim != 1:
        raise ValueError(f"apply_ep needs a 1-D ep mesh, got {ep_mesh.ndim}-D {ep_mesh}")
    ep = ep_mesh.size()
    for layer_id, block in model.layers.items():
        moe = getattr(block, "moe", None)
        if moe is None:
            continue
        experts = moe.experts
        if isinstance(experts.w1, DTensor):
            raise ValueError(f"apply_ep: layer {layer_id} already has expert parallel applied")
        # ParallelDims.check_model rejected such a layout before the model was built.
        assert experts.num_experts % ep == 0, f"layer {layer_id}: {experts.num_experts} % {ep}"
        distribute_module(experts, ep_mesh, partition_fn=_shard_experts)
        experts.dispatch = dispatch(ep_mesh)


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """distribute_module's partition_fn: the experts module's own parameters Shard(0) (its
    submodules, the adapters' dropout, hold none)."""
    if name:
        return
    for param_name, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(param.data, mesh, [Shard(0)])
        module.register_parameter(param_name, nn.Parameter(sharded, param.requires_grad))


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


def rank_in_expert_order(recv_WL: torch.Tensor, n_recv: int) -> torch.Tensor:
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
