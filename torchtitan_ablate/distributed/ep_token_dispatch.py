"""Expert parallel with token dispatch (`parallelism.expert_parallel_dispatch = "tokens"`).

Row dispatch (expert_parallel.py) sends a token once per chosen expert; here a token goes once to
every ep rank holding at least one of its top_k experts (DeepEP's layout) and comes back once per
such rank, summed there over its experts. At top-8 of 128 experts over 4 ranks a token reaches
3.6 ranks on average: 2.2x fewer rows in every all-to-all.

    plan      the rows to send are the (destination rank, token) pairs with a chosen expert
              there, in that order; one all-to-all of counts [W, L + 1] (pairs per local expert,
              then rows) and the layer's one host read (`CountReader.ep_token_splits`)
    dispatch  the rows, and per row K float32 (router weight, local expert or -1) slots
    compute   each (row, slot) pair with a local expert is placed straight into its expert's
              group (one move; the groups are the experts module's `layout`), the experts module
              runs whatever it computes (plain, float8, LoRA), and each received row sums its
              pairs' outputs times their router weights (one pass)
    combine   back to the senders; each token sums its rows (one pass)

Every sum runs in float32 (permute.py) without atomics: deterministic. The backward reuses the
forward's splits, so it syncs with the host nowhere. Under the estimator's forced routing
(estimator/routing.py) the host counts differ from the data's; every index is clamped to the sizes
the counts give, so the shapes are the forced ones.

Shape legend: T tokens of this rank, K top_k, D model dim, W ep degree, L local experts,
S rows sent, N rows received, M pairs computed here, X rows of the experts' groups.
"""

import torch
from torch.distributed._functional_collectives import (
    all_to_all_single,
    all_to_all_single_autograd,
)
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_ablate.models.common.experts import GroupedExperts, count_reader
from torchtitan_ablate.models.common.permute import combine_rows, inverse_permutation, move_rows


class TokenDispatch:
    """Each token goes once to every ep rank holding one of its experts and comes back summed.

    Installed by `apply_ep(model, ep_mesh, TokenDispatch)`; parallelize_qwen3 passes it for
    `expert_parallel_dispatch = "tokens"`."""

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        self.ep_mesh = ep_mesh

    def route(
        self,
        experts: GroupedExperts,
        x_TD: torch.Tensor,
        experts_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        counts_E: torch.Tensor,
    ) -> torch.Tensor:
        group, n_ranks = self.ep_mesh.get_group(), self.ep_mesh.size()
        n_tokens, top_k = experts_TK.shape
        n_local = counts_E.shape[0] // n_ranks
        device = x_TD.device
        with torch.no_grad():
            dest_TK = experts_TK // n_local
            rank_W = torch.arange(n_ranks, device=device)
            present_WT = (dest_TK.unsqueeze(0) == rank_W.view(-1, 1, 1)).any(dim=-1)
            rows_W = present_WT.sum(dim=1)
            send_WC = torch.cat([counts_E.view(n_ranks, n_local), rows_W.unsqueeze(1)], dim=1)
            recv_WC = all_to_all_single(send_WC.flatten(), None, None, group).view(n_ranks, -1)
            send, recv, n_pairs, recv_WL = count_reader().ep_token_splits(
                rows_W, recv_WC, n_tokens, top_k
            )
            token_S, dest_S, index_TW, valid_TW = _sent_rows(present_WT, send)
            here_SK = dest_TK[token_S] == dest_S.unsqueeze(1)
            local_SK = torch.where(here_SK, experts_TK[token_S] % n_local, -1)

        x_SD = move_rows(x_TD, token_S, None, 0, index_TW, valid_TW)
        # Only the slots whose expert is on the destination carry a weight (and its gradient).
        w_SK = torch.where(here_SK, weights_TK[token_S], 0.0)
        meta_SJ = torch.cat([w_SK.float(), local_SK.float()], dim=1)  # L < 2**24: exact
        x_ND = all_to_all_single_autograd(x_SD, recv, send, group)
        meta_NJ = all_to_all_single_autograd(meta_SJ, recv, send, group)
        w_NK, local_NK = meta_NJ[:, :top_k], meta_NJ[:, top_k:].detach().long()
        y_ND = _run_pairs(experts, x_ND, w_NK, local_NK, recv_WL.sum(0), n_pairs)
        back_SD = all_to_all_single_autograd(y_ND, send, recv, group)
        # Each token sums its rows: their backward hands each sent row its token's gradient.
        ones_TW = valid_TW.to(back_SD.dtype)
        sent_S = torch.arange(back_SD.shape[0], device=device)
        entries = (token_S, sent_S, token_S * n_ranks + dest_S)
        return combine_rows(back_SD, index_TW, ones_TW, valid_TW, entries)


def _run_pairs(
    experts: GroupedExperts,
    x_ND: torch.Tensor,
    w_NK: torch.Tensor,
    local_NK: torch.Tensor,
    counts_L: torch.Tensor,
    n_pairs: int,
) -> torch.Tensor:
    """y_ND[n] = sum over row n's slots k with a local expert (local_NK >= 0) of
    w_NK[n, k] * expert_{local_NK[n, k]}(x_ND[n]); counts_L: pairs per local expert."""
    n_rows, top_k = local_NK.shape
    with torch.no_grad():
        key_P = torch.where(local_NK >= 0, local_NK, counts_L.shape[0]).flatten()
        # Pairs with a local expert first, by expert, each expert's in (row, slot) order.
        order_P = key_P.argsort(stable=True)
        rank_NK = inverse_permutation(order_P).view(n_rows, top_k)
        valid_NK = (local_NK >= 0) & (rank_NK < n_pairs)
        src_M = order_P[:n_pairs] // top_k
        groups, dest_M = experts.layout(counts_L, n_pairs, x_ND)
        if dest_M is None:  # packed groups: the pairs in expert order
            dest_M = torch.arange(n_pairs, device=x_ND.device)
        index_NK = _first_real_elsewhere(dest_M[rank_NK.clamp(max=n_pairs - 1)], valid_NK)
    x_XD = move_rows(x_ND, src_M, dest_M, groups.n_rows, index_NK, valid_NK)
    # The module call: FSDP's hooks gather the experts' weights around the compute.
    out_XD = experts(x_XD, groups)
    entries = (src_M, dest_M, order_P[:n_pairs])
    return combine_rows(out_XD, index_NK, w_NK.to(out_XD.dtype), valid_NK, entries)


def _sent_rows(
    present_WT: torch.Tensor, send: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_S, dest_S, index_TW, valid_TW): the token and destination of each sent row, in
    (destination, token) order, and per token the sent row of each destination (valid_TW: it
    has one). send: rows per destination, as read on the host."""
    n_ranks, n_tokens = present_WT.shape
    n_sent = sum(send)
    device = present_WT.device
    flat = present_WT.flatten()
    slot_WT = torch.where(flat, flat.cumsum(0) - 1, n_sent).clamp(max=n_sent).view_as(present_WT)
    token_WT = torch.arange(n_tokens, device=device).expand(n_ranks, -1)
    # Entries that are not sent write to a spare slot past the end, dropped after.
    token_S = torch.zeros(n_sent + 1, dtype=torch.long, device=device)
    token_S = token_S.index_put((slot_WT.flatten(),), token_WT.flatten())[:n_sent]
    dest_S = torch.repeat_interleave(
        torch.arange(n_ranks, device=device), torch.tensor(send, device=device), output_size=n_sent
    )
    valid_TW = (slot_WT < n_sent).t()
    index_TW = _first_real_elsewhere(slot_WT.t().clamp(max=max(n_sent - 1, 0)), valid_TW)
    return token_S, dest_S, index_TW, valid_TW


def _first_real_elsewhere(index_TJ: torch.Tensor, valid_TJ: torch.Tensor) -> torch.Tensor:
    """index_TJ with each entry that is not real replaced by its row's first real one: the
    masked loads of permute.py's sums then hit rows already in cache."""
    first_T1 = index_TJ.gather(1, valid_TJ.int().argmax(dim=1, keepdim=True))
    return torch.where(valid_TJ, index_TJ, first_T1)
