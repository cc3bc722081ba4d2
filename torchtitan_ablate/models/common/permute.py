"""Row movements of the MoE layer whose backward passes never accumulate.

autograd differentiates `x[index]` with an accumulating scatter (index_put with accumulate=True)
and `index_select` with `index_add`, because in general an index may repeat. In the MoE layer
every index is a permutation or injective (each routed row is read once, each padded slot
written once), and the only repetition is known in advance: every token is routed to exactly
top_k experts. Writing that down gives backward passes made of gathers, plain scatters and one
k-way sum: no atomics, deterministic, and lowered by inductor into fused kernels (the
accumulating versions were 7% of the one-GPU MoE step on an H100, docs/performance.md).

Shape legend: T tokens, K top_k, R = T*K routed rows, D model dim, P padded rows, X rows of
any layout, S = T*K (token, k) slots.
"""

import torch
from torch.autograd import Function


class _RepeatSorted(Function):
    @staticmethod
    def forward(ctx, x_TD, order_R, inv_R, top_k: int):
        ctx.save_for_backward(inv_R)
        ctx.top_k = top_k
        return x_TD[order_R // top_k]

    @staticmethod
    def backward(ctx, grad_RD):
        (inv_R,) = ctx.saved_tensors
        # Row inv_R[t*K + k] holds token t's k-th copy: sum the K copies.
        return _sum_rows(grad_RD, inv_R.view(-1, ctx.top_k), None), None, None, None


class _CombineRows(Function):
    @staticmethod
    def forward(ctx, rows_XD, index_TK, w_TK):
        ctx.save_for_backward(rows_XD, index_TK, w_TK)
        return _sum_rows(rows_XD, index_TK, w_TK)

    @staticmethod
    def backward(ctx, grad_TD):
        rows_XD, index_TK, w_TK = ctx.saved_tensors
        acc = _acc_dtype(grad_TD)
        grad_SD = (grad_TD.to(acc)[:, None, :] * w_TK.to(acc)[:, :, None]).to(grad_TD.dtype)
        # index_TK holds no repeats; when it covers every row there is nothing to zero.
        covers_all = index_TK.numel() == rows_XD.shape[0]
        grad_XD = torch.empty_like(rows_XD) if covers_all else torch.zeros_like(rows_XD)
        grad_XD = grad_XD.index_put((index_TK.flatten(),), grad_SD.flatten(0, 1))
        # Each (t, k) reduces one contiguous row: coalesced loads.
        grad_w_TK = (rows_XD[index_TK].to(acc) * grad_TD.to(acc)[:, None, :]).sum(-1)
        return grad_XD, None, grad_w_TK.to(w_TK.dtype)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _sum_rows(
    rows_XD: torch.Tensor, index_TK: torch.Tensor, w_TK: torch.Tensor | None
) -> torch.Tensor:
    """y[t] = sum_k w[t, k] * rows[index[t, k]] (w = 1 when None), accumulated in float32.

    Written as K pointwise terms, not a reduction over k: inductor fuses them into one kernel
    whose K row loads are each contiguous, where a reduction over k tiles k across a warp's
    threads and reads K scattered rows per load (docs/performance.md)."""
    acc = _acc_dtype(rows_XD)
    y_TD = None
    for k in range(index_TK.shape[1]):
        term = rows_XD[index_TK[:, k]].to(acc)
        if w_TK is not None:
            term = term * w_TK[:, k : k + 1].to(acc)
        y_TD = term if y_TD is None else y_TD + term
    return y_TD.to(rows_XD.dtype)


class _GatherGrad(Function):
    """The backward of a forward(ctx, x, a, b) that saved one index with output row index_R[i] =
    input row i: x's gradient is a gather of the output's, a and b get none."""

    @staticmethod
    def backward(ctx, grad_out):
        (index_R,) = ctx.saved_tensors
        return grad_out[index_R], None, None


class _PermuteRows(_GatherGrad):
    @staticmethod
    def forward(ctx, x_RD, perm_R, inv_perm_R):
        ctx.save_for_backward(inv_perm_R)
        return x_RD[perm_R]


class _ScatterRows(_GatherGrad):
    @staticmethod
    def forward(ctx, x_RD, dest_R, n_rows: int):
        ctx.save_for_backward(dest_R)
        out = x_RD.new_zeros(n_rows, *x_RD.shape[1:])
        return out.index_put((dest_R,), x_RD)


class _GatherRows(Function):
    @staticmethod
    def forward(ctx, x_PD, src_R):
        ctx.save_for_backward(src_R)
        ctx.n_rows = x_PD.shape[0]
        return x_PD[src_R]

    @staticmethod
    def backward(ctx, grad_RD):
        (src_R,) = ctx.saved_tensors
        grad_PD = grad_RD.new_zeros(ctx.n_rows, *grad_RD.shape[1:])
        return grad_PD.index_put((src_R,), grad_RD), None


def inverse_permutation(perm_R: torch.Tensor) -> torch.Tensor:
    """inv[perm[i]] = i."""
    arange_R = torch.arange(perm_R.numel(), device=perm_R.device, dtype=perm_R.dtype)
    return torch.empty_like(perm_R).index_put((perm_R,), arange_R)


def repeat_sorted(
    x_TD: torch.Tensor, order_R: torch.Tensor, inv_R: torch.Tensor, top_k: int
) -> torch.Tensor:
    """x_TD[order_R // top_k]: each token once per chosen expert, in the order `order_R` of the
    flattened (token, k) slots; inv_R = inverse_permutation(order_R)."""
    return _RepeatSorted.apply(x_TD, order_R, inv_R, top_k)


def permute_rows(
    x_RD: torch.Tensor, perm_R: torch.Tensor, inv_perm_R: torch.Tensor
) -> torch.Tensor:
    """x_RD[perm_R] for a permutation perm_R with inverse inv_perm_R."""
    return _PermuteRows.apply(x_RD, perm_R, inv_perm_R)


def scatter_rows(x_RD: torch.Tensor, dest_R: torch.Tensor, n_rows: int) -> torch.Tensor:
    """n_rows rows of zeros with row dest_R[i] = x_RD[i]; dest_R holds no repeats."""
    return _ScatterRows.apply(x_RD, dest_R, n_rows)


def gather_rows(x_PD: torch.Tensor, src_R: torch.Tensor) -> torch.Tensor:
    """x_PD[src_R]; src_R holds no repeats (rows never read get a zero gradient)."""
    return _GatherRows.apply(x_PD, src_R)


def combine_rows(rows_XD: torch.Tensor, index_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """y_TD[t] = sum_k w_TK[t, k] * rows_XD[index_TK[t, k]] in one pass (float32 sums, as a
    batched matmul would); index_TK holds no repeats, rows it never reads get a zero gradient."""
    return _CombineRows.apply(rows_XD, index_TK, w_TK)
