"""Routed experts as 3-D weights: what moves the routed rows, and what computes on them.

Two parts, each replaceable on its own:

    dispatch  `experts.dispatch.route(experts, x_TD, experts_TK, weights_TK, counts_E)` takes
              the router's choices to the weighted combine: it decides where each (token, k)
              row is computed and places the rows into the experts' groups. `LocalDispatch`
              (here) sorts them by expert on this rank; expert parallel's dispatchers
              (distributed/) move them between ranks. `MoE.forward` calls `experts.route`.
    compute   `experts(x_XD, groups)`: each local expert's SwiGLU on its group of rows, laid out
              as `experts.layout` says (padded groups for `torch._grouped_mm`, one kernel for all
              experts, CUDA bf16; packed groups for the per-expert loop, CPU and tests). A module
              call, so FSDP's hooks gather the weights around it; the weights may be DTensors
              (expert parallel: this rank's shard computes) or torchao's float8 wrapper tensors
              (whose grouped GEMM runs in float8). `adapters` (lora.py's ExpertLoRA) adds its
              update to every projection.

Host reads of token counts (the only host syncs of the MoE layers) go through `CountReader`;
fake tensors have no counts, so the memory estimator installs its own with `read_counts_with`.

Shape legend: T tokens, K top_k, R = T*K routed rows (sorted by expert), D model dim, I expert
hidden dim, E experts, L experts computed here (E without expert parallel), X rows in groups
(padded or packed), O / N a projection's output / input dim.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_ablate.models.common.init import ParamInit, init_for
from torchtitan_ablate.models.common.permute import (
    combine_rows,
    gather_rows,
    inverse_permutation,
    repeat_sorted,
    scatter_rows,
)

# Rows per expert group are padded to this multiple for the grouped GEMM: bf16 kernels need 8
# (16 bytes), float8 kernels 16, so 16 serves both at a cost of < E * 16 zero rows.
GROUP_ALIGN_ROWS = 16


def use_grouped_mm(x_RD: torch.Tensor) -> bool:
    """The one place that chooses grouped GEMM vs the per-expert loop."""
    return hasattr(torch, "_grouped_mm") and x_RD.is_cuda and x_RD.dtype == torch.bfloat16


@dataclass
class ExpertGroups:
    """How the rows handed to the compute sit: one group per local expert, in expert order,
    padded to GROUP_ALIGN_ROWS (offs_L: int32 group ends, for the grouped GEMM; padding rows are
    never read back) or packed (splits: rows per expert on the host, for the loop)."""

    n_rows: int
    offs_L: torch.Tensor | None = None
    splits: list[int] | None = None

    @property
    def padded(self) -> bool:
        return self.offs_L is not None

    def linear(self, x_XN: torch.Tensor, w_LON: torch.Tensor) -> torch.Tensor:
        """x @ w[l].T for each expert l's group of rows."""
        if self.offs_L is not None:
            return torch._grouped_mm(x_XN, w_LON.transpose(-2, -1), offs=self.offs_L)
        parts = torch.split(x_XN, self.splits, dim=0)
        return torch.cat([x_rN @ w_LON[e].T for e, x_rN in enumerate(parts)], dim=0)


class Dispatch(Protocol):
    """Moves routed rows to the experts that compute them and their outputs back."""

    def route(
        self,
        experts: "GroupedExperts",
        x_TD: torch.Tensor,
        experts_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        counts_E: torch.Tensor,
    ) -> torch.Tensor: ...


class LocalDispatch:
    """No dispatch: this rank's (token, k) rows, sorted by expert, go to its own experts."""

    def route(
        self,
        experts: "GroupedExperts",
        x_TD: torch.Tensor,
        experts_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        counts_E: torch.Tensor,
    ) -> torch.Tensor:
        top_k = experts_TK.shape[1]
        # Sort rows by expert (stable, so rows of one expert keep token order), run, unsort.
        order_R = experts_TK.flatten().argsort(stable=True)
        inv_R = inverse_permutation(order_R)
        x_RD = repeat_sorted(x_TD, order_R, inv_R, top_k)
        out_RD = self.run_sorted(experts, x_RD, counts_E)
        # Unsort and weigh in one pass: token t's k-th output is sorted row inv_R[t*K + k].
        w_TK = weights_TK.to(out_RD.dtype)
        return combine_rows(out_RD, inv_R.view(-1, top_k), w_TK)

    def run_sorted(
        self, experts: "GroupedExperts", x_RD: torch.Tensor, counts_E: torch.Tensor
    ) -> torch.Tensor:
        """The experts' outputs for rows sorted by expert (counts_E per expert)."""
        return experts.run_rows(x_RD, counts_E)


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
        # The seams: apply_ep installs its dispatcher, apply_lora the expert adapters.
        self.dispatch: Dispatch = LocalDispatch()
        self.adapters: nn.Module | None = None

    def route(
        self,
        x_TD: torch.Tensor,
        experts_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        counts_E: torch.Tensor,
    ) -> torch.Tensor:
        """y_TD = sum_k weights_TK[t, k] * expert_{experts_TK[t, k]}(x_TD[t]); counts_E: int
        assignments per expert (summing to T*K)."""
        return self.dispatch.route(self, x_TD, experts_TK, weights_TK, counts_E)

    def layout(
        self, counts_L: torch.Tensor, n_rows: int, x: torch.Tensor
    ) -> tuple[ExpertGroups, torch.Tensor | None]:
        """The groups the compute takes n_rows rows in, in expert order (counts_L per local
        expert), and the row of the groups each of them goes to (None: its own, packed)."""
        if self.runs_grouped_mm(x):
            # A static size (no host sync); rows past offs[-1] are ignored by the kernel.
            dest_R, offs_L = padded_layout(counts_L, n_rows)
            return ExpertGroups(padded_rows(n_rows, counts_L.shape[0]), offs_L=offs_L), dest_R
        # The loop syncs for its splits: CPU / fp32 only, not the CUDA bf16 path.
        splits = count_reader().expert_splits(counts_L, n_rows)
        return ExpertGroups(n_rows, splits=splits), None

    def run_rows(
        self, x_RD: torch.Tensor, counts_L: torch.Tensor, rank_R: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The experts on rows in expert order, or in any order given rank_R (row i is the
        rank_R[i]-th in expert order): each row goes into its group and comes back out of it in
        one move each way; the outputs are in the input's order."""
        groups, dest_R = self.layout(counts_L, x_RD.shape[0], x_RD)
        if rank_R is not None:
            dest_R = rank_R if dest_R is None else dest_R[rank_R]
        if dest_R is None:
            return self(x_RD, groups)
        return gather_rows(self(scatter_rows(x_RD, dest_R, groups.n_rows), groups), dest_R)

    def forward(self, x_XD: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """Each local expert's SwiGLU on its group of x_XD; the output in the same layout."""
        # Expert parallel: the experts see only their own rows, so they compute on the local
        # shards; to_local() is differentiable and hands the gradient back as a Shard(0) DTensor.
        weights = {name: to_local(p) for name, p in self.named_parameters(recurse=False)}

        def project(x_XN: torch.Tensor, name: str) -> torch.Tensor:
            y_XO = groups.linear(x_XN, weights[name])
            if self.adapters is None:
                return y_XO
            return y_XO + self.adapters(x_XN, name, weights, groups)

        h_XI = F.silu(project(x_XD, "w1")) * project(x_XD, "w3")
        return project(h_XI, "w2")

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


def to_local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


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


def padded_rows(n_rows: int, n_experts: int) -> int:
    """Rows of the padded groups of n_rows rows in n_experts groups: R + E * (align - 1), rounded
    up to the alignment (float8's column-major copies need 16-byte strides)."""
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
