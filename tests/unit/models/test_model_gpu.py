"""CUDA-only: bf16 training steps through every attention backend, grouped-mm MoE, compile."""

import dataclasses

import pytest
import torch

from torchtitan_ablate.models.qwen3 import Qwen3Model, qwen3_flavors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
B, S = 2, 256


def cuda_model(backend: str, name: str = "debugmodel_moe") -> Qwen3Model:
    args = dataclasses.replace(qwen3_flavors[name], n_layers=2, attn_backend=backend)
    with torch.device("meta"):
        model = Qwen3Model(args)
    model.to_empty(device="cuda")
    torch.manual_seed(0)
    model.init_weights()
    return model.to(torch.bfloat16)


def batch(packed: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    g = torch.Generator().manual_seed(0)
    tokens_BS = torch.randint(0, 2048, (B, S), generator=g).cuda()
    if not packed:
        return tokens_BS, None, None
    lengths = [100, 60, 96, 256]  # row 0: three documents, row 1: one
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).view(B, S)
    positions = torch.cat([torch.arange(n) for n in lengths]).view(B, S)
    return tokens_BS, positions.cuda(), docs.cuda()


def step(model: Qwen3Model, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    tokens_BS, positions_BS, docs_BS = batch(packed)
    logits_BSV = model(tokens_BS, positions_BS, docs_BS)
    loss = logits_BSV.float().logsumexp(-1).mean()
    if model.moe_aux_loss() is not None:
        loss = loss + model.moe_aux_loss()
    loss.backward()
    return logits_BSV.float(), model.layers["0"].attention.wq.weight.grad.float()


def assert_bf16_close(logits, ref_logits, grad, ref_grad) -> None:
    """Close per token, except that bf16 noise may flip a near-tie MoE routing for a few tokens."""
    bad_tokens = ((logits - ref_logits).abs().amax(-1) > 5e-2).float().mean().item()
    assert bad_tokens < 0.02, f"{bad_tokens:.1%} of tokens differ"
    assert (grad - ref_grad).norm() < 0.05 * ref_grad.norm()


@pytest.mark.parametrize("name", ["debugmodel", "debugmodel_moe"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("backend", ["flex", "varlen", "flash"])
def test_backends_train_like_sdpa(backend: str, packed: bool, name: str) -> None:
    if backend == "flash":
        pytest.importorskip("flash_attn")
    ref_logits, ref_grad = step(cuda_model("sdpa", name), packed)
    logits, grad = step(cuda_model(backend, name), packed)
    if name == "debugmodel":
        torch.testing.assert_close(logits, ref_logits, atol=5e-2, rtol=5e-2)
    assert_bf16_close(logits, ref_logits, grad, ref_grad)


@pytest.mark.parametrize("name", ["debugmodel", "debugmodel_moe"])
def test_compiled_blocks_match_eager(name: str) -> None:
    eager_logits, eager_grad = step(cuda_model("sdpa", name), packed=True)
    model = cuda_model("sdpa", name)
    for layer_id, block in model.layers.items():
        model.layers[layer_id] = torch.compile(block)
    logits, grad = step(model, packed=True)
    assert_bf16_close(logits, eager_logits, grad, eager_grad)
