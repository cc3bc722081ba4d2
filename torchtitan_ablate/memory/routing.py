"""Forced MoE routing for the estimator: fake tensors have no values, so token counts are set.

Under fake tensors the router's choices are unknown and every host read of a count fails. The
MoE layers read counts on the host in one place, the `CountReader` of experts.py; `forced_routing`
installs a balanced one through its seam (`read_counts_with`) for its duration. Memory depends on
routing only through expert parallel's dispatch (without EP every rank runs all T * K routed rows
whatever the split). So the estimate assumes:

- balanced routing: every expert gets T * K / E rows, every EP rank receives as many rows as it
  sends (R = T * K);
- with `memory_estimation.ep_imbalance = F`, the modelled rank (rank 0) is the busiest EP rank
  and receives F * R rows (it sends R as usual).

The CPU estimate is checked against real gloo ranks running under the same forced routing
(validate.py), so both see the same shapes.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from torchtitan_ablate.models.common.experts import CountReader, read_counts_with


def even_splits(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


class BalancedCounts(CountReader):
    """Counts of balanced routing, known on the host without reading a tensor."""

    def __init__(self, ep_imbalance: float) -> None:
        self.ep_imbalance = ep_imbalance

    def expert_splits(self, counts_E: torch.Tensor, n_rows: int) -> list[int]:
        return even_splits(n_rows, counts_E.shape[0])

    def ep_splits(
        self, send_W: torch.Tensor, recv_WL: torch.Tensor, n_rows: int
    ) -> tuple[list[int], list[int], torch.Tensor]:
        n_ranks, n_local = recv_WL.shape
        blocks = even_splits(round(n_rows * self.ep_imbalance), n_ranks * n_local)
        recv_splits = [sum(blocks[w * n_local : (w + 1) * n_local]) for w in range(n_ranks)]
        # Made inside the fake mode: a shape-only stand-in, real on real ranks (validate.py).
        forced_WL = torch.tensor(blocks, device=recv_WL.device).view(n_ranks, n_local)
        return even_splits(n_rows, n_ranks), recv_splits, forced_WL


@contextmanager
def forced_routing(ep_imbalance: float) -> Iterator[None]:
    """Balanced routing (times `ep_imbalance` rows received by this rank under EP)."""
    with read_counts_with(BalancedCounts(ep_imbalance)):
        yield
