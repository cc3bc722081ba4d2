"""Attention backends behind one call: sdpa, flex, varlen, flash.

The model builds an `AttentionMask` once per forward (`build_attention_mask`) and every layer calls
`attention(q, k, v, mask)`. Causal everywhere; with `document_ids` (packed sequences) a token only
sees earlier tokens of its own document.

Shape legend: B batch, S sequence, H query heads, J kv heads, K head_dim, T = B*S tokens,
N documents in the whole batch.
"""

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

ATTN_BACKENDS = ("auto", "sdpa", "flex", "varlen", "flash")


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto': FlexAttention on CUDA, SDPA elsewhere. In compiled Qwen3-0.6B training on one
    H100, flex gave 91.0k tokens/s against 51.8k for SDPA's cuDNN kernel, whose backward ran
    3x slower inside the compiled blocks than alone (docs/performance.md)."""
    if backend == "auto":
        return "flex" if torch.device(device).type == "cuda" else "sdpa"
    return backend


# SDPA kernel priority on CUDA: cuDNN measured 436 TFLOP/s fwd+bwd causal at 4k on H100 against
# 246 for the flash kernel. The later entries keep shapes/masks cuDNN refuses working.
SDPA_CUDA_PRIORITY = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]

FLASH_MISSING = (
    "attn_backend='flash' needs the flash-attn package: pip install flash-attn (CUDA only), "
    "or use sdpa"
)


class DenseKernel:
    """The dense attention call behind the sdpa backend and context-parallel attention:
    F.scaled_dot_product_attention on [B, heads, S, K] inputs.

    The seam for the memory estimator, which installs a stand-in holding only what CUDA's fused
    kernels save (estimator/cuda_model.py) through `dense_kernel_with`; nothing else replaces it.
    `native_gqa_and_documents`: the kernel takes K/V at their own head count and packed
    documents without a dense mask (as flex, varlen and flash do), so neither the repeat of K/V
    to the query heads nor the [B, 1, S, S] document mask is built for it."""

    native_gqa_and_documents = False

    def __call__(self, q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa
        )


_dense_kernel = DenseKernel()


def dense_kernel() -> DenseKernel:
    return _dense_kernel


@contextmanager
def dense_kernel_with(kernel: DenseKernel) -> Iterator[None]:
    """Runs dense attention through `kernel` for the duration (the memory estimator's seam)."""
    global _dense_kernel
    saved, _dense_kernel = _dense_kernel, kernel
    try:
        yield
    finally:
        _dense_kernel = saved


@dataclass
class AttentionMask:
    """Everything besides q/k/v that one forward's attention needs; built once, used per layer."""

    backend: str
    dense_B1SS: torch.Tensor | None = None  # sdpa + documents: causal AND same document
    block_mask: BlockMask | None = None  # flex
    cu_seqlens: torch.Tensor | None = None  # varlen / flash + documents: int32 [N + 1]
    max_seqlen: int = 0  # an upper bound is enough for the kernels, so S (no host sync)


def build_attention_mask(
    backend: str,
    document_ids_BS: torch.Tensor | None,
    batch: int,
    seq_len: int,
    device: torch.device,
) -> AttentionMask:
    """Precompute the backend's mask structure for a [batch, seq_len] input."""
    backend = resolve_backend(backend, device)
    if backend == "sdpa":
        if document_ids_BS is None:
            return AttentionMask(backend)  # is_causal=True, no mask tensor
        if _dense_kernel.native_gqa_and_documents:  # the mask is never read: shape only
            return AttentionMask(
                backend, dense_B1SS=document_ids_BS.new_ones((1, 1, 1, 1), dtype=bool)
            )
        return AttentionMask(backend, dense_B1SS=_dense_document_mask(document_ids_BS))
    if backend == "flex":
        if document_ids_BS is None:
            return AttentionMask(backend, block_mask=_causal_block_mask(seq_len, str(device)))
        return AttentionMask(backend, block_mask=_document_block_mask(document_ids_BS))
    if backend in ("varlen", "flash"):
        cu_seqlens = _cu_seqlens(document_ids_BS, batch, seq_len, device)
        return AttentionMask(backend, cu_seqlens=cu_seqlens, max_seqlen=seq_len)
    raise ValueError(f"attn_backend={backend!r} is not one of {ATTN_BACKENDS}")


def attention(
    q_BSHK: torch.Tensor, k_BSJK: torch.Tensor, v_BSJK: torch.Tensor, mask: AttentionMask
) -> torch.Tensor:
    """Causal (optionally document-masked) attention; returns [B, S, H, K]."""
    if mask.backend == "sdpa":
        return _sdpa(q_BSHK, k_BSJK, v_BSJK, mask.dense_B1SS)
    if mask.backend == "flex":
        flex = _COMPILED_FLEX if q_BSHK.is_cuda else flex_attention
        out_BHSK = flex(
            q_BSHK.transpose(1, 2),
            k_BSJK.transpose(1, 2),
            v_BSJK.transpose(1, 2),
            block_mask=mask.block_mask,
            enable_gqa=True,
        )
        return out_BHSK.transpose(1, 2)
    if mask.backend == "varlen":
        return _varlen(q_BSHK, k_BSJK, v_BSJK, mask)
    if mask.backend == "flash":
        return _flash(q_BSHK, k_BSJK, v_BSJK, mask)
    raise ValueError(f"attn_backend={mask.backend!r} is not one of {ATTN_BACKENDS}")


# ---- sdpa ----------------------------------------------------------------------------------------


def _dense_document_mask(document_ids_BS: torch.Tensor) -> torch.Tensor:
    seq_len = document_ids_BS.shape[1]
    same_doc_BSS = document_ids_BS.unsqueeze(2) == document_ids_BS.unsqueeze(1)
    causal_SS = torch.ones(seq_len, seq_len, dtype=torch.bool, device=document_ids_BS.device).tril()
    return (same_doc_BSS & causal_SS).unsqueeze(1)


def _sdpa(q_BSHK, k_BSJK, v_BSJK, dense_B1SS: torch.Tensor | None) -> torch.Tensor:
    # K/V are repeated to H heads rather than passing enable_gqa=True: the cuDNN kernel (fastest on
    # Hopper) does not take GQA inputs, and SDPA would silently pick a slower kernel.
    kernel = _dense_kernel
    if not kernel.native_gqa_and_documents:
        q_BSHK, k_BSJK, v_BSJK = _repeat_kv(q_BSHK, k_BSJK, v_BSJK)
    q_BHSK, k_BHSK, v_BHSK = (t.transpose(1, 2) for t in (q_BSHK, k_BSJK, v_BSJK))
    kwargs = {"is_causal": True} if dense_B1SS is None else {"attn_mask": dense_B1SS}
    if q_BHSK.is_cuda:
        with sdpa_kernel(SDPA_CUDA_PRIORITY, set_priority=True):
            out_BHSK = kernel(q_BHSK, k_BHSK, v_BHSK, **kwargs)
    else:
        out_BHSK = kernel(q_BHSK, k_BHSK, v_BHSK, **kwargs)
    return out_BHSK.transpose(1, 2)


def _repeat_kv(q_BSHK, k_BSJK, v_BSJK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_rep = q_BSHK.shape[2] // k_BSJK.shape[2]
    if n_rep == 1:
        return q_BSHK, k_BSJK, v_BSJK
    return q_BSHK, k_BSJK.repeat_interleave(n_rep, 2), v_BSJK.repeat_interleave(n_rep, 2)


# ---- flex ----------------------------------------------------------------------------------------


# Eager flex materialises the full score matrix, so CUDA runs the compiled kernel (torch.compile
# is lazy: nothing compiles until the first CUDA call). On CPU the eager op is kept: forward
# works there, backward is refused by torch either way.
_COMPILED_FLEX = torch.compile(flex_attention)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=8)
def _causal_block_mask(seq_len: int, device: str) -> BlockMask:
    return create_block_mask(_causal, None, None, seq_len, seq_len, device=device)


def _document_block_mask(document_ids_BS: torch.Tensor) -> BlockMask:
    def causal_same_document(b, h, q_idx, kv_idx):
        same_doc = document_ids_BS[b, q_idx] == document_ids_BS[b, kv_idx]
        return (q_idx >= kv_idx) & same_doc

    batch, seq_len = document_ids_BS.shape
    # Built every forward (documents change). Eager, its vmapped mask_mod kept the CPU busy ~8 ms
    # at the start of each step while the GPU idled (Qwen3-0.6B, batch 8 x 4096, H200 trace);
    # compiled as context_parallel.py's. The CPU keeps the eager build (no inductor in tests).
    return create_block_mask(
        causal_same_document,
        batch,
        None,
        seq_len,
        seq_len,
        device=document_ids_BS.device,
        _compile=document_ids_BS.is_cuda,
    )


# ---- varlen / flash ------------------------------------------------------------------------------


def _cu_seqlens(document_ids_BS, batch: int, seq_len: int, device) -> torch.Tensor:
    if document_ids_BS is None:
        return torch.arange(batch + 1, dtype=torch.int32, device=device) * seq_len
    doc_T = document_ids_BS.flatten()
    starts_T = torch.ones_like(doc_T, dtype=torch.bool)
    starts_T[1:] = doc_T[1:] != doc_T[:-1]
    starts_T[::seq_len] = True  # a row always starts a document, even if ids repeat across rows
    # nonzero syncs with the host once per forward: the document count is data-dependent.
    starts_N = starts_T.nonzero().flatten()
    end = torch.full((1,), doc_T.numel(), dtype=starts_N.dtype, device=device)
    return torch.cat([starts_N, end]).to(torch.int32)


def _varlen(q_BSHK, k_BSJK, v_BSJK, mask: AttentionMask) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    # torch 2.10/2.11 say is_causal=True and have no GQA flag; 2.12+ say window_size=(-1, 0).
    params = inspect.signature(varlen_attn).parameters
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    else:
        q_BSHK, k_BSJK, v_BSJK = _repeat_kv(q_BSHK, k_BSJK, v_BSJK)
    batch, seq_len = q_BSHK.shape[:2]
    q_THK, k_TJK, v_TJK = (t.flatten(0, 1) for t in (q_BSHK, k_BSJK, v_BSJK))
    cu, n = mask.cu_seqlens, mask.max_seqlen
    try:
        out_THK = varlen_attn(q_THK, k_TJK, v_TJK, cu, cu, n, n, **kwargs)
    except NotImplementedError as err:
        raise RuntimeError(
            f"attn_backend='varlen' has no {q_THK.device.type} kernel in torch (it wraps the CUDA "
            "flash-attention kernel); use attn_backend='sdpa' there"
        ) from err
    return out_THK.unflatten(0, (batch, seq_len))


@functools.cache
def flash_attn_module():
    """The flash-attn package, or None where it is not installed."""
    try:
        import flash_attn
    except ImportError:
        return None
    return flash_attn


def _flash(q_BSHK, k_BSJK, v_BSJK, mask: AttentionMask) -> torch.Tensor:
    flash_attn = flash_attn_module()
    if flash_attn is None:
        raise RuntimeError(FLASH_MISSING)
    batch, seq_len = q_BSHK.shape[:2]
    if mask.cu_seqlens is None or mask.cu_seqlens.numel() == batch + 1:
        # One document per row (or no documents): the plain kernel, GQA handled natively.
        return flash_attn.flash_attn_func(q_BSHK, k_BSJK, v_BSJK, causal=True)
    q_THK, k_TJK, v_TJK = (t.flatten(0, 1) for t in (q_BSHK, k_BSJK, v_BSJK))
    cu, n = mask.cu_seqlens, mask.max_seqlen
    out_THK = flash_attn.flash_attn_varlen_func(q_THK, k_TJK, v_TJK, cu, cu, n, n, causal=True)
    return out_THK.unflatten(0, (batch, seq_len))
