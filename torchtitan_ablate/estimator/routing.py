"""Forced MoE routing for the estimator: fake tensors have no values, so token counts are set.

Under fake tensors the router's choices are unknown and every host read of a count fails. The
MoE layers read counts on the host in one place, the `CountReader` of experts.py; `forced_routing`
installs a balanced one through its seam (`read_counts_with`) for its duration. Memory depends on
routing only through expert parallel's dispatch (without EP every rank runs all T * K routed rows
whatever the split). So the estimate assumes:

- balanced routing: every expert gets T * K / E rows, every EP rank receives as many rows as it
  sends (R = T * K; under token dispatch T * W * (1 - C(E - L, K) / C(E, K)) token rows, the
  chance that a token has an expert on a given rank of W, L = E / W experts each);
- with `memory_estimation.ep_imbalance = F`, the modelled rank (rank 0) is the busiest EP rank
  and receives F * R rows (it sends R as usual).

The CPU estimate is checked against real gloo ranks running under the same forced routing
(validate.py), so both see the same shapes.
"""

import math
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

    def ep_token_splits(
        self, rows_W: torch.Tensor, recv_WC: torch.Tensor, n_tokens: int, top_k: int
    ) -> tuple[list[int], list[int], int, torch.Tensor]:
        n_ranks, n_local = recv_WC.shape[0], recv_WC.shape[1] - 1
        n_experts = n_ranks * n_local
        # A token goes to a rank when one of its top_k (distinct, uniform) experts lives there.
        reach = 1 - math.comb(n_experts - n_local, top_k) / math.comb(n_experts, top_k)
        # The same count each way between every pair of ranks, so real ranks (validate.py)
        # agree on every split.
        per_rank = round(n_tokens * reach)
        send = [per_rank] * n_ranks
        recv = even_splits(round(per_rank * n_ranks * self.ep_imbalance), n_ranks)
        pairs = round(n_tokens * top_k * self.ep_imbalance)
        blocks = even_splits(pairs, n_experts)
        forced_WL = torch.tensor(blocks, device=recv_WC.device).view(n_ranks, n_local)
        return send, recv, pairs, forced_WL


@contextmanager
def forced_routing(ep_imbalance: float) -> Iterator[None]:
    """Balanced routing (times `ep_imbalance` rows received by this rank under EP)."""
    with read_counts_with(BalancedCounts(ep_imbalance)):
        yield
