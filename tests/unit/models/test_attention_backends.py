"""Attention backends agree with each other and with per-document reference attention."""

import dataclasses
import warnings

import pytest
import torch

from torchtitan_ablate.models.common.attention import attention, build_attention_mask
from torchtitan_ablate.models.qwen3 import Qwen3Model, qwen3_flavors

# flex on CPU runs unfused and says so on every call; the message is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

B, S, H, J, K = 2, 24, 4, 2, 16
DOCS_BS = torch.tensor([[0] * 10 + [1] * 8 + [2] * 6, [3] * 5 + [4] * 19])
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def qkv(device: str = "cpu", dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, n, K, generator=g) for n in (H, J, J))
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def reference(q_BSHK, k_BSJK, v_BSJK, document_ids_BS=None) -> torch.Tensor:
    """Plain softmax attention, causal and (optionally) within documents."""
    k_BSHK = k_BSJK.repeat_interleave(H // J, 2)
    v_BSHK = v_BSJK.repeat_interleave(H // J, 2)
    scores_BHSS = torch.einsum("bqhk,bshk->bhqs", q_BSHK, k_BSHK) / K**0.5
    allowed_BSS = torch.ones(S, S, dtype=torch.bool, device=q_BSHK.device).tril().expand(B, S, S)
    if document_ids_BS is not None:
        allowed_BSS = allowed_BSS & (document_ids_BS[:, :, None] == document_ids_BS[:, None, :])
    scores_BHSS = scores_BHSS.masked_fill(~allowed_BSS[:, None], float("-inf"))
    return torch.einsum("bhqs,bshk->bqhk", scores_BHSS.softmax(-1), v_BSHK)


def run(backend: str, q, k, v, document_ids_BS=None) -> torch.Tensor:
    mask = build_attention_mask(backend, document_ids_BS, B, S, q.device)
    return attention(q, k, v, mask)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("packed", [False, True])
def test_cpu_backends_match_reference(backend: str, packed: bool) -> None:
    q, k, v = qkv()
    docs = DOCS_BS if packed else None
    torch.testing.assert_close(run(backend, q, k, v, docs), reference(q, k, v, docs))


def test_sdpa_packed_equals_documents_run_separately() -> None:
    q, k, v = qkv()
    out_BSHK = run("sdpa", q, k, v, DOCS_BS)
    for b in range(B):
        for doc in DOCS_BS[b].unique():
            idx = (DOCS_BS[b] == doc).nonzero().flatten()
            one = [t[b : b + 1, idx] for t in (q, k, v)]
            mask = build_attention_mask("sdpa", None, 1, len(idx), q.device)
            torch.testing.assert_close(out_BSHK[b : b + 1, idx], attention(*one, mask))


def test_varlen_and_flash_explain_themselves_on_cpu() -> None:
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="attn_backend='varlen' has no cpu kernel"):
        run("varlen", q, k, v)
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="needs the flash-attn package"):
            run("flash", q, k, v)


def test_flash_without_the_package_is_a_config_error_at_build() -> None:
    from torchtitan_ablate.build import build_model, check_layout
    from torchtitan_ablate.config import ConfigError, load_config
    from torchtitan_ablate.models.common.attention import flash_attn_module

    if flash_attn_module() is not None:
        pytest.skip("flash-attn is installed")
    config = load_config(["--model.attn_backend", "flash"])
    layout = check_layout(config, 1)
    with pytest.raises(ConfigError, match="needs the flash-attn package"):
        build_model(config, layout.parallel_dims, layout.model_args, torch.device("cpu"))


def test_cu_seqlens_from_document_ids() -> None:
    mask = build_attention_mask("varlen", DOCS_BS, B, S, torch.device("cpu"))
    assert mask.cu_seqlens.tolist() == [0, 10, 18, 24, 29, 48]
    assert mask.cu_seqlens.dtype == torch.int32
    # The same id on both sides of a row boundary is still two sequences.
    same_BS = torch.zeros(B, S, dtype=torch.long)
    mask = build_attention_mask("varlen", same_BS, B, S, torch.device("cpu"))
    assert mask.cu_seqlens.tolist() == [0, 24, 48]


def tiny_model(backend: str) -> Qwen3Model:
    args = dataclasses.replace(qwen3_flavors["debugmodel"], n_layers=2, attn_backend=backend)
    torch.manual_seed(0)
    model = Qwen3Model(args)
    model.init_weights()
    return model.eval()


def test_model_flex_equals_sdpa() -> None:
    tokens_BS = torch.randint(0, 2048, (B, S))
    with torch.no_grad():
        sdpa_BSV = tiny_model("sdpa")(tokens_BS)
        flex_BSV = tiny_model("flex")(tokens_BS, document_ids_BS=torch.zeros(B, S, dtype=int))
    torch.testing.assert_close(flex_BSV, sdpa_BSV, atol=1e-5, rtol=1e-5)


def test_model_packed_equals_documents_run_separately() -> None:
    model = tiny_model("sdpa")
    tokens_BS = torch.randint(0, 2048, (B, S))
    positions_BS = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):  # positions restart per document, as the data loader supplies them
        for doc in DOCS_BS[b].unique():
            idx = (DOCS_BS[b] == doc).nonzero().flatten()
            positions_BS[b, idx] = torch.arange(len(idx))
    with torch.no_grad():
        packed_BSV = model(tokens_BS, positions_BS, DOCS_BS)
        for b in range(B):
            for doc in DOCS_BS[b].unique():
                idx = (DOCS_BS[b] == doc).nonzero().flatten()
                alone_1SV = model(tokens_BS[b : b + 1, idx])
                torch.testing.assert_close(packed_BSV[b : b + 1, idx], alone_1SV)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("backend", ["sdpa", "flex", "varlen", "flash"])
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_backends_match_reference(backend: str, packed: bool) -> None:
    if backend == "flash":
        pytest.importorskip("flash_attn")
    q, k, v = qkv("cuda", torch.bfloat16)
    docs = DOCS_BS.cuda() if packed else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = run(backend, q, k, v, docs)
    expected = reference(q.float(), k.float(), v.float(), docs)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
