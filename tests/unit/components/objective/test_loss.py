import dataclasses

import pytest
import torch

from torchtitan_ablate.components.objective.loss import (
    IGNORE_INDEX,
    chunked_linear_cross_entropy_sum,
    chunked_loss_head,
    cross_entropy_sum,
)
from torchtitan_ablate.models.qwen3 import Qwen3Model, qwen3_flavors


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 13, 32, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(50, 32, generator=g) * 0.2).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (2, 13), generator=g)
    labels[0, :4] = IGNORE_INDEX
    labels[1, -1] = IGNORE_INDEX
    return h, w, labels


@pytest.mark.parametrize(
    "chunk,compiled", [(1, False), (5, False), (13, False), (26, False), (100, False), (5, True)]
)
def test_chunked_matches_plain_value_and_grads(chunk, compiled):
    h, w, labels = _inputs(torch.float32)
    ref = cross_entropy_sum(h @ w.T, labels)
    ref.backward(torch.tensor(0.7))
    ref_gh, ref_gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    got = chunked_linear_cross_entropy_sum(h, w, labels, chunk, compiled=compiled)
    got.backward(torch.tensor(0.7))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(h.grad, ref_gh, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w.grad, ref_gw, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 5, 100])
def test_chunked_without_grad_is_the_plain_value(chunk):
    h, w, labels = _inputs(torch.float32)
    ref = cross_entropy_sum(h @ w.T, labels)
    with torch.no_grad():  # validation: the loss alone
        got = chunked_linear_cross_entropy_sum(h, w, labels, chunk)
    assert not got.requires_grad
    torch.testing.assert_close(got, ref.detach(), atol=1e-5, rtol=1e-6)


def test_chunked_bf16_close_to_plain():
    h, w, labels = _inputs(torch.bfloat16)
    ref = cross_entropy_sum(h @ w.T, labels)
    got = chunked_linear_cross_entropy_sum(h, w, labels, 8)
    torch.testing.assert_close(got, ref, atol=1e-2, rtol=1e-3)


def test_all_ignored_gives_zero_loss_and_grads():
    h, w, labels = _inputs(torch.float32)
    labels.fill_(IGNORE_INDEX)
    loss = chunked_linear_cross_entropy_sum(h, w, labels, 4)
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().sum() == 0 and w.grad.abs().sum() == 0


@pytest.mark.parametrize("tied", [True, False])
def test_model_loss_path_matches_logits_path(tied):
    args = dataclasses.replace(
        qwen3_flavors["debugmodel"], dim=64, n_heads=4, n_kv_heads=2, head_dim=16,
        hidden_dim=128, n_layers=2, vocab_size=128, tie_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3Model(args)
    model.init_weights()
    tokens = torch.randint(0, 128, (2, 24))
    labels = torch.randint(0, 128, (2, 24))
    ref = cross_entropy_sum(model(tokens), labels)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = model(tokens, labels_BS=labels, loss_head=chunked_loss_head(10))
    got.backward()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], atol=1e-5, rtol=1e-4)
