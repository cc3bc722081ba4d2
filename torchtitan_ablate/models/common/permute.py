"""Row movements of the MoE layer whose backward passes never accumulate.

autograd differentiates `x[index]` with an accumulating scatter (index_put with accumulate=True)
and `index_select` with `index_add`, because in general an index may repeat. In the MoE layer
every index is a permutation or injective (each routed row is read once, each padded slot
written once), and the only repetition is known in advance: every token is routed to exactly
top_k experts. Writing that down gives backward passes made of gathers, plain scatters and one
k-way sum: no atomics, deterministic, and lowered by inductor into fused kernels (accumulating
scatters cost 7% of the one-GPU MoE step's GPU time on an H100).

Shape legend: T tokens, K top_k, R = T*K routed rows, D model dim, P padded rows, X rows of
any layout, S = T*K (token, k) slots.
"""

import torch
from torch.autograd import Function


class _MoveRows(Function):
    """out[dest_Y[y]] = x[src_Y[y]] (dest_Y None: out = x[src_Y]); out rows nobody writes are
    zero. A row of x may be read several times: index_TJ lists, per row t, where its copies
    landed in out (valid_TJ marks the real entries; None: all), and the backward sums them."""

    @staticmethod
    def forward(ctx, x_TD, src_Y, dest_Y, n_out: int, index_TJ, valid_TJ):
        ctx.save_for_backward(index_TJ, valid_TJ)
        rows_YD = x_TD[src_Y]
        if dest_Y is None:
            return rows_YD
        return rows_YD.new_zeros(n_out, *rows_YD.shape[1:]).index_put((dest_Y,), rows_YD)

    @staticmethod
    def backward(ctx, grad_out):
        index_TJ, valid_TJ = ctx.saved_tensors
        return _sum_rows(grad_out, index_TJ, None, valid_TJ), None, None, None, None, None


class _CombineRows(Function):
    """y[t] = sum over the real k of w[t, k] * rows[index[t, k]]. With every entry real the
    backward works on the [T, K] table; otherwise on the list of real entries (src_Y: their t,
    dest_Y: their row of rows, slot_Y: t * K + k), so each is computed and written once."""

    @staticmethod
    def forward(ctx, rows_XD, w_TK, index_TK, valid_TK, src_Y, dest_Y, slot_Y):
        ctx.save_for_backward(rows_XD, w_TK, index_TK, src_Y, dest_Y, slot_Y)
        return _sum_rows(rows_XD, index_TK, w_TK, valid_TK)

    @staticmethod
    def backward(ctx, grad_TD):
        rows_XD, w_TK, index_TK, src_Y, dest_Y, slot_Y = ctx.saved_tensors
        acc = _acc_dtype(grad_TD)
        # dest_Y holds no repeats; when it covers every row there is nothing to zero.
        covers_all = dest_Y.numel() == rows_XD.shape[0]
        grad_XD = torch.empty_like(rows_XD) if covers_all else torch.zeros_like(rows_XD)
        grad_w_TK = None
        if src_Y is None:  # every entry real (combine_rows passes no list then)
            grad_SD = (grad_TD.to(acc)[:, None, :] * w_TK.to(acc)[:, :, None]).to(grad_TD.dtype)
            grad_XD = grad_XD.index_put((index_TK.flatten(),), grad_SD.flatten(0, 1))
            if ctx.needs_input_grad[1]:
                # Each (t, k) reduces one contiguous row: coalesced loads.
                grad_w_TK = (rows_XD[index_TK].to(acc) * grad_TD.to(acc)[:, None, :]).sum(-1)
                grad_w_TK = grad_w_TK.to(w_TK.dtype)
            return grad_XD, grad_w_TK, None, None, None, None, None
        grad_YD = grad_TD[src_Y].to(acc)
        w_Y = w_TK.flatten()[slot_Y].to(acc)
        grad_XD = grad_XD.index_put((dest_Y,), (grad_YD * w_Y[:, None]).to(grad_TD.dtype))
        if ctx.needs_input_grad[1]:
            grad_w_Y = (rows_XD[dest_Y].to(acc) * grad_YD).sum(-1).to(w_TK.dtype)
            grad_w_TK = w_TK.new_zeros(w_TK.numel()).index_put((slot_Y,), grad_w_Y)
            grad_w_TK = grad_w_TK.view_as(w_TK)
        return grad_XD, grad_w_TK, None, None, None, None, None


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _sum_rows(
    rows_XD: torch.Tensor,
    index_TK: torch.Tensor,
    w_TK: torch.Tensor | None,
    valid_TK: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[t] = sum over the real k (valid_TK; None: all) of w[t, k] * rows[index[t, k]] (w = 1
    when None), accumulated in float32. Entries that are not real must still index a row (best
    one of the same t's: its load is then a cache hit).

    Written as K pointwise terms, not a reduction over k: inductor fuses them into one kernel
    whose K row loads are each contiguous, where a reduction over k tiles k across a warp's
    threads and reads K scattered rows per load (docs/performance.md)."""
    acc = _acc_dtype(rows_XD)
    y_TD = None
    for k in range(index_TK.shape[1]):
        term = rows_XD[index_TK[:, k]].to(acc)
        if w_TK is not None:
            term = term * w_TK[:, k : k + 1].to(acc)
        if valid_TK is not None:
            term = torch.where(valid_TK[:, k : k + 1], term, 0.0)
        y_TD = term if y_TD is None else y_TD + term
    return y_TD.to(rows_XD.dtype)


class _GatherGrad(Function):
    """The backward of a forward(ctx, x, a, b) that saved one index with output row index_R[i] =
    input row i: x's gradient is a gather of the output's, a and b get none."""

    @staticmethod
    def backward(ctx, grad_out):
        (index_R,) = ctx.saved_tensors
        return grad_out[index_R], None, None


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
    # Row inv_R[t*K + k] holds token t's k-th copy: the backward sums the K copies.
    return _MoveRows.apply(x_TD, order_R // top_k, None, 0, inv_R.view(-1, top_k), None)


def move_rows(
    x_TD: torch.Tensor,
    src_Y: torch.Tensor,
    dest_Y: torch.Tensor | None,
    n_out: int,
    index_TJ: torch.Tensor,
    valid_TJ: torch.Tensor | None,
) -> torch.Tensor:
    """out[dest_Y[y]] = x_TD[src_Y[y]] in n_out zero rows (dest_Y None: x_TD[src_Y]); rows of
    x_TD read several times list their copies' rows of out in index_TJ (valid_TJ marks the real
    entries), for the backward's sum."""
    return _MoveRows.apply(x_TD, src_Y, dest_Y, n_out, index_TJ, valid_TJ)


def scatter_rows(x_RD: torch.Tensor, dest_R: torch.Tensor, n_rows: int) -> torch.Tensor:
    """n_rows rows of zeros with row dest_R[i] = x_RD[i]; dest_R holds no repeats."""
    return _ScatterRows.apply(x_RD, dest_R, n_rows)


def gather_rows(x_PD: torch.Tensor, src_R: torch.Tensor) -> torch.Tensor:
    """x_PD[src_R]; src_R holds no repeats (rows never read get a zero gradient)."""
    return _GatherRows.apply(x_PD, src_R)


def combine_rows(
    rows_XD: torch.Tensor,
    index_TK: torch.Tensor,
    w_TK: torch.Tensor,
    valid_TK: torch.Tensor | None = None,
    entries: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """y_TD[t] = sum_k w_TK[t, k] * rows_XD[index_TK[t, k]] in one pass (float32 sums, as a
    batched matmul would). With valid_TK only its real entries count (the others must still
    index a row) and `entries` lists them: (t, row of rows_XD, t * K + k) each. Real entries
    index distinct rows; rows none of them reads get a zero gradient."""
    if valid_TK is None:  # every entry real: the backward works on the table itself
        entries = (None, index_TK.flatten(), None)
    elif entries is None:
        raise ValueError("combine_rows: entries must list the real entries of valid_TK")
    return _CombineRows.apply(rows_XD, w_TK, index_TK, valid_TK, *entries)
