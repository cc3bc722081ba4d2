"""Routed experts as 3-D weights: the route from top-k choices to the weighted combine.

`GroupedExperts.route(x_TD, experts_TK, weights_TK, counts_E)` is the seam for expert parallel:
here it sorts the (token, k) rows by expert, runs `forward` and combines the k outputs of each
token with the router weights; `ExpertParallelExperts.route` (distributed/) moves tokens between
ranks instead. `forward(x_sorted_RD, counts_E)` is the compute kernel over rows sorted by expert,
one of two exact computations: `torch._grouped_mm` (one kernel for all experts; CUDA bf16) or a
per-expert loop (CPU, tests). It stays a module call, so FSDP's hooks on the experts wrap it.

Host reads of token counts (the only host syncs of the MoE layers) go through `CountReader`;
fake tensors have no counts, so the memory estimator installs its own with `read_counts_with`.

Shape legend: T tokens, K top_k, R = T*K routed rows (sorted by expert), D model dim, I expert
hidden dim, E experts, P padded rows, W ep degree.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_ablate.models.common.init import ParamInit, init_for
from torchtitan_ablate.models.common.permute import (
    combine_rows,
    gather_rows,
    inverse_permutation,
    permute_rows,
    repeat_sorted,
    scatter_rows,
)

# Rows per expert group are padded to this multiple for the grouped GEMM: bf16 kernels need 8
# (16 bytes), float8 kernels 16, so 16 serves both at a cost of < E * 16 zero rows.
GROUP_ALIGN_ROWS = 16


def use_grouped_mm(x_RD: torch.Tensor) -> bool:
    """The one place that chooses grouped GEMM vs the per-expert loop."""
    return hasattr(torch, "_grouped_mm") and x_RD.is_cuda and x_RD.dtype == torch.bfloat16


class GroupedExperts(nn.Module):
    """E SwiGLU experts: w1 (gate) [E, I, D], w3 (up) [E, I, D], w2 (down) [E, D, I]."""

    def __init__(
        self, dim: int, hidden_dim: int, num_experts: int, grouped_mm: bool | None = None
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        # None = automatic (use_grouped_mm); True/False force one path (the estimator models
        # CUDA's grouped GEMM on CPU; tests compare the two paths).
        self.force_grouped_mm = grouped_mm

    def route(
        self,
        x_TD: torch.Tensor,
        experts_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        counts_E: torch.Tensor,
    ) -> torch.Tensor:
        """y_TD = sum_k weights_TK[t, k] * expert_{experts_TK[t, k]}(x_TD[t]); counts_E: int
        assignments per expert (summing to T*K)."""
        top_k = experts_TK.shape[1]
        # Sort rows by expert (stable, so rows of one expert keep token order), run, unsort.
        order_R = experts_TK.flatten().argsort(stable=True)
        inv_R = inverse_permutation(order_R)
        out_sorted_RD = self(repeat_sorted(x_TD, order_R, inv_R, top_k), counts_E)
        # Unsort and weigh in one pass: token t's k-th output is sorted row inv_R[t*K + k].
        w_TK = weights_TK.to(out_sorted_RD.dtype)
        return combine_rows(out_sorted_RD, inv_R.view(-1, top_k), w_TK)

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """x_RD: rows sorted by expert; num_tokens_per_expert_E: int counts summing to R."""
        if self.runs_grouped_mm(x_RD):
            return _grouped_mm_experts(self.w1, self.w2, self.w3, x_RD, num_tokens_per_expert_E)
        return _loop_experts(self.w1, self.w2, self.w3, x_RD, num_tokens_per_expert_E)

    def runs_grouped_mm(self, x_RD: torch.Tensor) -> bool:
        """The path for these rows: the forced one, else use_grouped_mm's choice."""
        forced = self.force_grouped_mm
        return use_grouped_mm(x_RD) if forced is None else forced

    def init_weights(self, init_std: float, init: ParamInit | None = None) -> None:
        # Expert parallel's shards too: `init` draws each global tensor and keeps this rank's.
        init = init_for(self, init)
        init.trunc_normal_(self.w1, 0.02)
        init.trunc_normal_(self.w2, init_std)
        init.trunc_normal_(self.w3, init_std)


class CountReader:
    """Reads MoE token counts on the host. The default reads the tensors (a device->host sync);
    the memory estimator installs one that assumes a routing (estimator/routing.py)."""

    def expert_splits(self, counts_E: torch.Tensor, n_rows: int) -> list[int]:
        """Rows per expert for the per-expert loop (a CPU path: not taken on CUDA bf16)."""
        return counts_E.tolist()

    def ep_splits(
        self, send_W: torch.Tensor, recv_WL: torch.Tensor, n_rows: int
    ) -> tuple[list[int], list[int], torch.Tensor]:
        """Expert parallel's one sync per layer and forward: rows this rank sends to / receives
        from each ep rank, and recv_WL (rows from source rank w for local expert l) to plan the
        received rows with. send_W: rows per destination; n_rows: rows this rank routes."""
        send_splits, recv_splits = torch.stack([send_W, recv_WL.sum(1)]).tolist()
        return send_splits, recv_splits, recv_WL

    def ep_token_splits(
        self, rows_W: torch.Tensor, recv_WC: torch.Tensor, n_tokens: int, top_k: int
    ) -> tuple[list[int], list[int], int, torch.Tensor]:
        """Token dispatch's one sync per layer and forward: rows (tokens) this rank sends to /
        receives from each ep rank, the (row, local expert) pairs it computes, and recv_WL
        (pairs from source rank w for local expert l). rows_W: rows per destination; recv_WC
        [W, L + 1]: pairs per local expert, then rows, from each source rank."""
        recv_WL = recv_WC[:, :-1]
        host = torch.cat([rows_W, recv_WC[:, -1], recv_WL.sum().view(1)]).tolist()
        n_ranks = rows_W.shape[0]
        return host[:n_ranks], host[n_ranks:-1], host[-1], recv_WL


_reader = CountReader()


def count_reader() -> CountReader:
    return _reader


@contextmanager
def read_counts_with(reader: CountReader) -> Iterator[None]:
    """Installs `reader` for the MoE layers' host reads of token counts while the block runs.
    The one way to change them: the memory estimator calls it, nothing else does."""
    global _reader
    saved, _reader = _reader, reader
    try:
        yield
    finally:
        _reader = saved


def _loop_experts(
    w1_EID, w2_EDI, w3_EID, x_RD, num_tokens_per_expert_E, rank_R=None
) -> torch.Tensor:
    """rank_R: as for _grouped_mm_experts."""

    def run(x_RD: torch.Tensor) -> torch.Tensor:
        splits = _reader.expert_splits(num_tokens_per_expert_E, x_RD.shape[0])
        out_RD = []
        for e, x_rD in enumerate(torch.split(x_RD, splits, dim=0)):
            h_rI = F.silu(x_rD @ w1_EID[e].T) * (x_rD @ w3_EID[e].T)
            out_RD.append(h_rI @ w2_EDI[e].T)
        return torch.cat(out_RD, dim=0)

    return in_expert_order(run, x_RD, rank_R)


def in_expert_order(
    run: Callable[[torch.Tensor], torch.Tensor], x_RD: torch.Tensor, rank_R: torch.Tensor | None
) -> torch.Tensor:
    """run(rows sorted by expert) on rows in any order, row i being the rank_R[i]-th in expert
    order (None: already sorted); the outputs come back in the input's order."""
    if rank_R is None:
        return run(x_RD)
    order_R = inverse_permutation(rank_R)
    return permute_rows(run(permute_rows(x_RD, order_R, rank_R)), rank_R, order_R)


def _grouped_mm_experts(
    w1_EID, w2_EDI, w3_EID, x_RD, num_tokens_per_expert_E, rank_R=None
) -> torch.Tensor:
    """x_RD sorted by expert, or in any order given rank_R (row i is the rank_R[i]-th in expert
    order): the rows then go into and come out of the padded groups in one move each way."""
    x_PD, dest_R, offs_E = pad_by_expert(x_RD, num_tokens_per_expert_E, rank_R)
    return gather_rows(grouped_mm_swiglu(w1_EID, w2_EDI, w3_EID, x_PD, offs_E), dest_R)


def grouped_mm_swiglu(w1_EID, w2_EDI, w3_EID, x_PD, offs_E) -> torch.Tensor:
    """The experts on rows already in padded groups (int32 group end offsets offs_E)."""
    gate_PI = torch._grouped_mm(x_PD, w1_EID.transpose(-2, -1), offs=offs_E)
    up_PI = torch._grouped_mm(x_PD, w3_EID.transpose(-2, -1), offs=offs_E)
    h_PI = F.silu(gate_PI) * up_PI
    return torch._grouped_mm(h_PI, w2_EDI.transpose(-2, -1), offs=offs_E)


def pad_by_expert(
    x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor, rank_R: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows sorted by expert (or ranked in expert order by rank_R), copied into groups padded to
    GROUP_ALIGN_ROWS for the grouped GEMM: (x_PD, destination row of each input row, int32
    group end offsets).

    The padded size is static (R + E * (align - 1), rounded up to the alignment: float8's
    column-major copies need 16-byte strides), so no host sync; rows past offs[-1] are ignored
    by the kernel and never read back."""
    dest_R, offs_E = padded_layout(num_tokens_per_expert_E, x_RD.shape[0])
    if rank_R is not None:
        dest_R = dest_R[rank_R]
    n_padded = padded_rows(x_RD.shape[0], num_tokens_per_expert_E.shape[0])
    return scatter_rows(x_RD, dest_R, n_padded), dest_R, offs_E


def padded_rows(n_rows: int, n_experts: int) -> int:
    """Rows of the padded buffer of n_rows rows in n_experts groups (see pad_by_expert)."""
    n_padded = n_rows + n_experts * (GROUP_ALIGN_ROWS - 1)
    return -(-n_padded // GROUP_ALIGN_ROWS) * GROUP_ALIGN_ROWS


def padded_layout(
    num_tokens_per_expert_E: torch.Tensor, n_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Destination row of each sorted row in the padded buffer, and int32 cumulative offsets."""
    counts_E = num_tokens_per_expert_E.to(torch.int64)
    padded_E = (counts_E + GROUP_ALIGN_ROWS - 1) // GROUP_ALIGN_ROWS * GROUP_ALIGN_ROWS
    ends_E = counts_E.cumsum(0)
    padded_ends_E = padded_E.cumsum(0)
    row_R = torch.arange(n_rows, device=counts_E.device)
    expert_R = torch.searchsorted(ends_E, row_R, right=True)
    shift_E = (padded_ends_E - padded_E) - (ends_E - counts_E)  # padded start - packed start
    return row_R + shift_E[expert_R], padded_ends_E.to(torch.int32)
