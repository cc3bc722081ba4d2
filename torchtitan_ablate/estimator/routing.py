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

A run with `debug.moe_force_load_balance` routes by the round-robin slots of moe.py's
`round_robin_expert` instead: the same balanced rows per expert, and under token dispatch the
token rows that pattern sends, counted exactly (`RoundRobinCounts`; ep_imbalance is 1 there).

The CPU estimate is checked against real gloo ranks running under the same forced routing
(validate.py), so both see the same shapes.
"""

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from torchtitan_ablate.models.common.experts import CountReader, read_counts_with
from torchtitan_ablate.models.common.moe import round_robin_expert


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


class RoundRobinCounts(BalancedCounts):
    """Counts of debug.moe_force_load_balance's round-robin routing: every EP rank routes its
    n_tokens alike, so rank w sends each rank v the tokens of its own pattern that reach v."""

    def __init__(self) -> None:
        super().__init__(ep_imbalance=1.0)

    def ep_token_splits(
        self, rows_W: torch.Tensor, recv_WC: torch.Tensor, n_tokens: int, top_k: int
    ) -> tuple[list[int], list[int], int, torch.Tensor]:
        n_ranks, n_local = recv_WC.shape[0], recv_WC.shape[1] - 1
        tokens_W, pairs_E = round_robin_reach(n_tokens, top_k, n_ranks * n_local, n_ranks)
        recv = [tokens_W[0]] * n_ranks  # every source sends this rank what it sends rank 0
        forced_WL = torch.tensor([pairs_E[:n_local]] * n_ranks, device=recv_WC.device)
        return tokens_W, recv, n_ranks * sum(pairs_E[:n_local]), forced_WL


def round_robin_reach(
    n_tokens: int, top_k: int, n_experts: int, n_ranks: int
) -> tuple[list[int], list[int]]:
    """Under round-robin routing of n_tokens tokens: how many reach each of n_ranks EP ranks
    (experts in contiguous blocks), and the (token, expert) pairs of each expert. The pattern
    repeats every n_experts / gcd(n_experts, top_k) tokens, so one period is counted."""
    period = n_experts // math.gcd(n_experts, top_k)
    per_rank = n_experts // n_ranks
    tokens_W, pairs_E = [0] * n_ranks, [0] * n_experts
    for t in range(min(n_tokens, period)):
        times = n_tokens // period + (t < n_tokens % period)
        slots = [(t * top_k + k) % n_experts for k in range(top_k)]
        experts = [round_robin_expert(slot, n_experts, top_k) for slot in slots]
        for rank in {e // per_rank for e in experts}:
            tokens_W[rank] += times
        for e in experts:
            pairs_E[e] += times
    return tokens_W, pairs_E


@contextmanager
def forced_routing(ep_imbalance: float, force_load_balance: bool = False) -> Iterator[None]:
    """Balanced routing (times `ep_imbalance` rows received by this rank under EP), or with
    force_load_balance (debug.moe_force_load_balance) the run's own round-robin routing."""
    reader = RoundRobinCounts() if force_load_balance else BalancedCounts(ep_imbalance)
    with read_counts_with(reader):
        yield
