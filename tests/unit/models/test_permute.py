"""The MoE row movements equal autograd's indexing ops, values and gradients (float64)."""

import torch

from torchtitan_ablate.models.common.permute import (
    gather_rows,
    inverse_permutation,
    permute_rows,
    repeat_sorted,
    scatter_rows,
)


def _grads(fn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_()
    y = fn(x)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    return y.detach(), x.grad


def test_inverse_permutation() -> None:
    perm = torch.randperm(50)
    inv = inverse_permutation(perm)
    assert torch.equal(perm[inv], torch.arange(50)) and torch.equal(inv[perm], torch.arange(50))


def test_repeat_sorted_and_unsort_match_indexing() -> None:
    torch.manual_seed(0)
    tokens, top_k, dim = 13, 3, 5
    x = torch.randn(tokens, dim, dtype=torch.float64)
    order = torch.randint(0, 4, (tokens * top_k,)).argsort(stable=True)
    inv = inverse_permutation(order)
    torch.manual_seed(1)
    got = _grads(lambda t: repeat_sorted(t, order, inv, top_k), x)
    torch.manual_seed(1)
    ref = _grads(lambda t: t[order // top_k], x)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    rows = torch.randn(tokens * top_k, dim, dtype=torch.float64)
    torch.manual_seed(2)
    got = _grads(lambda t: permute_rows(t, inv, order), rows)
    torch.manual_seed(2)
    ref = _grads(lambda t: torch.empty_like(t).index_copy(0, order, t), rows)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_scatter_and_gather_rows_match_index_copy_and_select() -> None:
    torch.manual_seed(0)
    rows, padded, dim = 9, 16, 4
    dest = torch.randperm(padded)[:rows]  # injective, with slots left empty
    x = torch.randn(rows, dim, dtype=torch.float64)
    torch.manual_seed(1)
    got = _grads(lambda t: scatter_rows(t, dest, padded), x)
    torch.manual_seed(1)
    ref = _grads(lambda t: t.new_zeros(padded, dim).index_copy(0, dest, t), x)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    xp = torch.randn(padded, dim, dtype=torch.float64)
    torch.manual_seed(2)
    got = _grads(lambda t: gather_rows(t, dest), xp)
    torch.manual_seed(2)
    ref = _grads(lambda t: t.index_select(0, dest), xp)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
