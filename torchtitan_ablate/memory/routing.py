"""Forced MoE routing for the estimator: fake tensors have no values, so token counts are set.

Under fake tensors the router's choices are unknown and every host read of a count (`.tolist()`)
fails. Memory depends on routing only through the rows each rank receives under expert parallel
(without EP every rank runs all T * K routed rows whatever the split). So the estimate assumes:

- balanced routing: every expert gets T * K / E rows, every EP rank receives as many rows as it
  sends (R = T * K);
- with `memory_estimation.ep_imbalance = F`, the modelled rank (rank 0) is the busiest EP rank and
  receives F * R rows (it sends R as usual).

`forced_routing` patches, for its duration only, the two places that read counts on the host:
expert parallel's dispatch plan and the per-expert loop of the experts.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from torchtitan_ablate.distributed import expert_parallel
from torchtitan_ablate.models.common import experts as experts_mod

_orig_ep_forward = expert_parallel.ExpertParallelExperts.forward
_orig_loop = experts_mod._loop_experts


def even_splits(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


class _HostCounts(list):
    """Counts known on the host, standing in for the tensor the loop calls .tolist() on."""

    def tolist(self) -> list[int]:
        return list(self)


def _balanced_loop(w1_EID, w2_EDI, w3_EID, x_RD, num_tokens_per_expert_E) -> torch.Tensor:
    """The original per-expert loop with equal, host-known counts."""
    counts = _HostCounts(even_splits(x_RD.shape[0], w1_EID.shape[0]))
    return _orig_loop(w1_EID, w2_EDI, w3_EID, x_RD, counts)


@contextmanager
def forced_routing(ep_imbalance: float) -> Iterator[None]:
    """Balanced routing (times `ep_imbalance` rows received by this rank under EP)."""
    state: dict[str, int] = {}

    def ep_forward(self, x_RD, num_tokens_per_expert_E):
        state["rows"] = x_RD.shape[0]
        return _orig_ep_forward(self, x_RD, num_tokens_per_expert_E)

    def plan_dispatch(counts_E, ep, group):
        rows = state["rows"]
        n_local = counts_E.shape[0] // ep
        received = round(rows * ep_imbalance)
        device = counts_E.device
        return expert_parallel._DispatchPlan(
            send_splits=even_splits(rows, ep),
            recv_splits=even_splits(received, ep),
            counts_L=torch.tensor(even_splits(received, n_local), device=device),
            perm_N=torch.arange(received, device=device),
        )

    saved = (
        expert_parallel._plan_dispatch,
        expert_parallel._loop_experts,
        experts_mod._loop_experts,
    )
    expert_parallel.ExpertParallelExperts.forward = ep_forward
    expert_parallel._plan_dispatch = plan_dispatch
    expert_parallel._loop_experts = experts_mod._loop_experts = _balanced_loop
    try:
        yield
    finally:
        expert_parallel.ExpertParallelExperts.forward = _orig_ep_forward
        expert_parallel._plan_dispatch, expert_parallel._loop_experts = saved[:2]
        experts_mod._loop_experts = saved[2]
