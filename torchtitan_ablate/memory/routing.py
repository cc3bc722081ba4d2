"""Forced MoE routing for the estimator: fake tensors have no values, so token counts are set.

Under fake tensors the router's choices are unknown and every host read of a count fails. The
MoE layers read counts on the host in one place, the `CountReader` of experts.py; `forced_routing`
installs a balanced one through its seam (`read_counts_with`) for its duration. Memory depends on
routing only through expert parallel's dispatch (without EP every rank runs all T * K routed rows
whatever the split). So the estimate assumes:

- balanced routing: every expert gets as many rows as every other;
- EP's deduplicated dispatch at its upper bound: each token goes to min(K, W) ranks (S = T *
  min(K, W) rows sent, as many received), and every rank computes T * K (row, expert) pairs;
- with `memory_estimation.ep_imbalance = F`, the modelled rank (rank 0) is the busiest EP rank:
  it receives F * S rows and computes F * T * K pairs (it sends S as usual).

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
        self, send_W: torch.Tensor, recv_W: torch.Tensor, n_pairs: torch.Tensor, shape: tuple
    ) -> tuple[list[int], list[int], int]:
        n_tokens, top_k, n_ranks = shape
        sent = n_tokens * min(top_k, n_ranks)
        received = round(sent * self.ep_imbalance)
        pairs = round(n_tokens * top_k * self.ep_imbalance)
        return even_splits(sent, n_ranks), even_splits(received, n_ranks), pairs


@contextmanager
def forced_routing(ep_imbalance: float) -> Iterator[None]:
    """Balanced routing (times `ep_imbalance` rows received by this rank under EP)."""
    with read_counts_with(BalancedCounts(ep_imbalance)):
        yield
