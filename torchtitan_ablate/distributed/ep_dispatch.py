"""Deduplicated expert-parallel dispatch (as DeepEP): a token goes once to each ep rank that holds
at least one of its top_k experts, not once per expert, and comes back once per such rank.

    plan      destination of slot (t, k) = expert // L; the S sent rows are the distinct
              (destination, token) pairs in that order. One all-to-all of counts [W, L + 1]
              (pairs per local expert, rows) and ONE host read (`CountReader.ep_splits`): row
              splits both ways and M, the (row, local expert) pairs this rank computes
    dispatch  all-to-all of the S rows and of [S, 2K] float32 metadata: the K router weights
              (differentiable) and the K local expert ids on the destination (-1: elsewhere)
    compute   the M pairs in local-expert order (stable sort: deterministic), gathered, run
              by the experts, weighted and summed per received row in float32
    combine   all-to-all back with the splits reversed; each token sums its rows in float32

Rows repeat on the way out (a token to several ranks, a received row to several local experts)
and are summed on the way back. Both directions are written as a gather and a sum over a slot
table, each the other's backward: no accumulating scatter, deterministic. The backward reuses the
forward's splits, so it syncs with the host nowhere. Nothing is divided by a token count here
(expert_parallel.py says why).

Shape legend: T tokens of this rank, K top_k, D model dim, E experts, W ep degree, L = E / W
local experts, S rows sent, N rows received, M pairs computed here, J slots per row.
"""

import torch
from torch import nn
from torch.autograd import Function
from torch.distributed._functional_collectives import (
    all_to_all_single,
    all_to_all_single_autograd,
)

from torchtitan_ablate.models.common.experts import count_reader
from torchtitan_ablate.models.common.permute import gather_rows, inverse_permutation


def dedup_route(
    experts: nn.Module,
    x_TD: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    counts_E: torch.Tensor,
) -> torch.Tensor:
    """ExpertParallelExperts.route: experts(x_MD, counts_L) computes this rank's local experts."""
    mesh = experts.ep_mesh
    group, n_ranks = mesh.get_group(), mesh.size()
    n_tokens, top_k = experts_TK.shape
    n_local = counts_E.shape[0] // n_ranks

    # 1. Plan: which (destination, token) rows to send, and their slot metadata.
    with torch.no_grad():
        dest_TK = experts_TK // n_local
        ranks_W11 = torch.arange(n_ranks, device=x_TD.device).view(-1, 1, 1)
        present_WT = (dest_TK == ranks_W11).any(dim=-1)
        send_WC = torch.cat([counts_E.view(n_ranks, n_local), present_WT.sum(1, keepdim=True)], 1)
        recv_WC = all_to_all_single(send_WC.flatten(), None, None, group).view(n_ranks, -1)
        send_splits, recv_splits, n_pairs = count_reader().ep_splits(
            send_WC[:, -1], recv_WC[:, -1], recv_WC[:, :-1].sum(), (n_tokens, top_k, n_ranks)
        )
        counts_L = recv_WC[:, :-1].sum(0)
        n_sent = sum(send_splits)
        # Present (destination, token) entries first, in (destination, token) order.
        order_WT = (~present_WT).flatten().to(torch.uint8).argsort(stable=True)
        slots_WT = _slots(order_WT, n_sent).view(n_ranks, n_tokens)
        sent_S = order_WT[:n_sent]
        token_S, dest_S = sent_S % n_tokens, sent_S // n_tokens
        local_SK = torch.where(
            dest_TK[token_S] == dest_S[:, None], experts_TK[token_S] % n_local, -1
        )

    # 2. Dispatch: rows and metadata (local ids are exact in float32: L < 2**24).
    x_SD = _GatherRepeated.apply(x_TD, token_S, slots_WT)
    w_SK = _GatherRepeated.apply(weights_TK.float(), token_S, slots_WT)
    meta_SJ = torch.cat([w_SK, local_SK.to(w_SK.dtype)], dim=1)
    x_ND = all_to_all_single_autograd(x_SD, recv_splits, send_splits, group)
    meta_NJ = all_to_all_single_autograd(meta_SJ, recv_splits, send_splits, group)

    # 3. Compute: the (row, slot) pairs with a local expert, grouped by local expert.
    w_NK = meta_NJ[:, :top_k]
    with torch.no_grad():
        local_NK = meta_NJ[:, top_k:].long()
        key_P = torch.where(local_NK >= 0, local_NK, n_local).flatten()
        order_P = key_P.argsort(stable=True)
        slots_KN = _slots(order_P, n_pairs).view(-1, top_k).t()
        pair_M = order_P[:n_pairs]
        row_M = pair_M // top_k
    x_MD = _GatherRepeated.apply(x_ND, row_M, slots_KN)
    w_M = gather_rows(w_NK.reshape(-1), pair_M)
    out_MD = experts(x_MD, counts_L)
    y_ND = _SumSlots.apply(out_MD, w_M, row_M, slots_KN)

    # 4. Combine.
    back_SD = all_to_all_single_autograd(y_ND, send_splits, recv_splits, group)
    return _SumSlots.apply(back_SD, None, token_S, slots_WT)


def _slots(order: torch.Tensor, n_kept: int) -> torch.Tensor:
    """Position of each entry in `order[:n_kept]`, or n_kept where it is not kept."""
    inv = inverse_permutation(order)
    return torch.where(inv < n_kept, inv, n_kept)


def _acc_dtype(y: torch.Tensor) -> torch.dtype:
    return torch.promote_types(y.dtype, torch.float32)


def _sum_slots(
    y_PD: torch.Tensor, slots_JR: torch.Tensor, w_P: torch.Tensor | None
) -> torch.Tensor:
    """out[r] = sum over j with slots_JR[j, r] < P of (w_P * y_PD)[slots_JR[j, r]], accumulated
    in float32 (float64 stays float64)."""
    n_rows, dim = y_PD.shape
    acc_RD = y_PD.new_zeros(slots_JR.shape[1], dim, dtype=_acc_dtype(y_PD))
    if n_rows == 0:
        return acc_RD
    for slot_R in slots_JR:
        src_R = slot_R.clamp(max=n_rows - 1)
        term_RD = y_PD[src_R].masked_fill_((slot_R >= n_rows)[:, None], 0)
        if w_P is None:
            acc_RD += term_RD
        else:
            acc_RD.addcmul_(term_RD, w_P[src_R, None])
    return acc_RD


class _GatherRepeated(Function):
    """x[src_P], where a row of x may repeat; slots_JR[:, r] lists its copies (P: none).
    Backward: each row sums its copies' gradients (the adjoint of _SumSlots)."""

    @staticmethod
    def forward(ctx, x_RD, src_P, slots_JR):
        ctx.save_for_backward(slots_JR)
        return x_RD[src_P]

    @staticmethod
    def backward(ctx, grad_PD):
        (slots_JR,) = ctx.saved_tensors
        return _sum_slots(grad_PD, slots_JR, None).to(grad_PD.dtype), None, None


class _SumSlots(Function):
    """out[r] = sum of (w_P * y_PD) over row r's slots, accumulated in float32, in y's dtype;
    w_P (float32) may be None. src_P[p]: the row that entry p belongs to (slots' inverse)."""

    @staticmethod
    def forward(ctx, y_PD, w_P, src_P, slots_JR):
        ctx.save_for_backward(y_PD if w_P is not None else None, w_P, src_P)
        return _sum_slots(y_PD, slots_JR, w_P).to(y_PD.dtype)

    @staticmethod
    def backward(ctx, grad_RD):
        y_PD, w_P, src_P = ctx.saved_tensors
        grad_PD = grad_RD[src_P]
        if w_P is None:
            return grad_PD, None, None, None
        acc_dtype = _acc_dtype(y_PD)
        grad_y = (grad_PD.to(acc_dtype) * w_P[:, None]).to(y_PD.dtype)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad_PD.to(acc_dtype) * y_PD.to(acc_dtype)).sum(-1).to(w_P.dtype)
        return grad_y, grad_w, None, None
