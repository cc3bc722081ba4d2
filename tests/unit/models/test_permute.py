"""The MoE row movements equal autograd's indexing ops, values and gradients (float64)."""

import pytest
import torch

from torchtitan_ablate.models.common.permute import (
    combine_rows,
    gather_rows,
    inverse_permutation,
    move_rows,
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


def test_repeat_sorted_matches_indexing() -> None:
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


def test_combine_rows_matches_indexing_and_bmm() -> None:
    torch.manual_seed(0)
    tokens, top_k, dim, padded = 7, 3, 5, 30
    # Injective index into more rows than it reads (padding rows get a zero gradient), and a
    # permutation of all rows (the expert-parallel case).
    for n_rows, index in ((padded, torch.randperm(padded)[: tokens * top_k]), (21, None)):
        index = torch.randperm(n_rows) if index is None else index
        index_TK = index.view(tokens, top_k)
        rows = torch.randn(n_rows, dim, dtype=torch.float64, requires_grad=True)
        w = torch.rand(tokens, top_k, dtype=torch.float64, requires_grad=True)
        g = torch.randn(tokens, dim, dtype=torch.float64)
        got = combine_rows(rows, index_TK, w)
        (got * g).sum().backward()
        got_grads = rows.grad, w.grad
        rows.grad = w.grad = None
        ref = torch.bmm(w.unsqueeze(1), rows[index_TK]).squeeze(1)
        (ref * g).sum().backward()
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
        for a, b in zip(got_grads, (rows.grad, w.grad)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _CUDA])])
def test_bf16_row_moves_match_float64(device) -> None:
    """In bf16, combine_rows and repeat_sorted's backward (float32 sums; on CUDA the fused kernels
    inductor makes of them) equal float64 indexing and bmm on the same bf16-exact inputs up to
    the rounding of their bf16 results."""
    torch.manual_seed(0)
    tokens, top_k, dim, experts = 4096, 8, 256, 16
    exact = lambda *shape: torch.randn(*shape).bfloat16().to(device)  # noqa: E731
    x, g = exact(tokens, dim), exact(tokens, dim)
    w = torch.rand(tokens, top_k).bfloat16().to(device)
    order = torch.randint(0, experts, (tokens * top_k,)).argsort(stable=True).to(device)
    inv = inverse_permutation(order)

    def move(x, w):
        rows = repeat_sorted(x, order, inv, top_k) * 2  # stands in for the experts (exact)
        return combine_rows(rows, inv.view(-1, top_k), w)

    def reference(x, w):
        rows = x[order // top_k] * 2
        return torch.bmm(w.unsqueeze(1), rows[inv].view(tokens, top_k, dim)).squeeze(1)

    results = []
    fn = torch.compile(move) if device == "cuda" else move
    for f, dtype in ((fn, torch.bfloat16), (reference, torch.float64)):
        xa, wa = (t.detach().to(dtype, copy=True).requires_grad_() for t in (x, w))
        y = f(xa, wa)
        y.backward(g.to(dtype))
        results.append([t.double() for t in (y, xa.grad, wa.grad)])
    for got, ref in zip(*results):
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


def test_masked_combine_and_move_rows_match_indexing() -> None:
    """Tables with entries that are not real (token dispatch: a row's slots whose expert is on
    another rank): only real entries count, values and gradients, each written once."""
    torch.manual_seed(0)
    tokens, slots, dim, n_rows = 6, 3, 4, 20
    valid = torch.rand(tokens, slots) < 0.6
    valid[:, 0] = True  # every token has a real entry
    real = int(valid.sum())
    index = torch.full((tokens, slots), -1)
    index[valid] = torch.randperm(n_rows)[:real]  # real entries read distinct rows
    index = torch.where(valid, index, index[:, :1])  # the others: the token's first real row
    t_Y, k_Y = valid.nonzero(as_tuple=True)
    entries = (t_Y, index[t_Y, k_Y], t_Y * slots + k_Y)
    rows = torch.randn(n_rows, dim, dtype=torch.float64, requires_grad=True)
    w = torch.rand(tokens, slots, dtype=torch.float64, requires_grad=True)
    g = torch.randn(tokens, dim, dtype=torch.float64)
    (combine_rows(rows, index, w, valid, entries) * g).sum().backward()
    got = rows.grad, w.grad
    rows.grad = w.grad = None
    ref = (rows[index] * (w * valid)[..., None]).sum(1)
    (ref * g).sum().backward()
    for a, b in zip(got, (rows.grad, w.grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # move_rows: each real entry's row of out is its token's row; the backward sums them.
    x = torch.randn(tokens, dim, dtype=torch.float64, requires_grad=True)
    out = move_rows(x, entries[0], entries[1], n_rows, index, valid)
    gout = torch.randn(n_rows, dim, dtype=torch.float64)
    (out * gout).sum().backward()
    expected = torch.zeros(n_rows, dim, dtype=torch.float64).index_copy(0, entries[1], x[t_Y])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    ref_grad = (gout[index] * valid[..., None]).sum(1)
    torch.testing.assert_close(x.grad, ref_grad, rtol=1e-12, atol=1e-12)
