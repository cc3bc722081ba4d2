"""What differs on CUDA from the fake-cpu program, and how the estimate accounts for it.

Each adjustment is listed (with its reason) in docs/memory_estimation.md:

1. dtypes: the CPU trainer computes in float32 unless `training.cpu_mixed_precision`; CUDA uses
   `training.mixed_precision_param` (bf16). The estimate sets cpu_mixed_precision, so FSDP's
   MixedPrecisionPolicy is the CUDA one.
2. optimizer: `optimizer.implementation = auto` is fused on CUDA (no per-step temporaries) and
   foreach on CPU; the estimate builds the optimizer for "cuda".
3. routed experts: CUDA bf16 runs `torch._grouped_mm` on rows padded per expert; the estimate
   forces that path (`Qwen3ModelArgs.moe_grouped_mm`), which has a CPU meta kernel.
4. attention: CUDA's cuDNN / flash / FlexAttention kernels save only q, k, v, out and the
   log-sum-exp (float32 [B, H, S]) for backward, plus the additive bias when a dense mask is
   given (SDPA turns a bool mask into a bias of the query dtype for cuDNN / efficient
   attention); their backward holds a float32 dq accumulator. `cuda_attention` replaces
   F.scaled_dot_product_attention by a stand-in with exactly those tensors. For the kernels
   that take GQA and document masks natively (flex, the CUDA choice of attn_backend "auto";
   varlen; flash) K/V stay at kv heads and no dense mask exists.
5. caching allocator: every block is rounded up to 512 bytes (`ROUND_BYTES`).
6. CUDA context + NCCL communicators: a constant reported separately (`context_gib`).
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

ROUND_BYTES = 512  # CUDACachingAllocator: kMinBlockSize, and every size is a multiple of it
CONTEXT_GIB_SINGLE = 0.5  # CUDA context + cuBLAS/cuDNN workspaces on an H100 (torch 2.x)
CONTEXT_GIB_NCCL = 1.0  # the same plus NCCL communicators' buffers with world size > 1


def context_gib(world_size: int) -> float:
    return CONTEXT_GIB_NCCL if world_size > 1 else CONTEXT_GIB_SINGLE


class _FusedAttention(torch.autograd.Function):
    """Shapes and saved tensors of a fused attention kernel (values are not computed)."""

    @staticmethod
    def forward(ctx, q_BHLK, k_BJSK, v_BJSK, mask):
        out_BHLK = q_BHLK.new_empty(q_BHLK.shape[:-1] + (v_BJSK.shape[-1],))
        lse_BHL = q_BHLK.new_empty(q_BHLK.shape[:-1], dtype=torch.float32)
        saved = [q_BHLK, k_BJSK, v_BJSK, out_BHLK, lse_BHL]
        if mask is not None:
            saved.append(mask.new_empty(mask.shape, dtype=q_BHLK.dtype))  # the additive bias
        ctx.save_for_backward(*saved)
        return out_BHLK

    @staticmethod
    def backward(ctx, grad_out_BHLK):
        q_BHLK, k_BJSK, v_BJSK = ctx.saved_tensors[:3]
        dq_accum_BHLK = q_BHLK.new_empty(q_BHLK.shape, dtype=torch.float32)
        dq_BHLK = torch.empty_like(q_BHLK)
        del dq_accum_BHLK
        return dq_BHLK, torch.empty_like(k_BJSK), torch.empty_like(v_BJSK), None


_native_kernel = False  # set by cuda_attention(native_kernel=True)


def _fused_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    return _FusedAttention.apply(query, key, value, None if _native_kernel else attn_mask)


@contextmanager
def cuda_attention(native_kernel: bool) -> Iterator[None]:
    """Routes F.scaled_dot_product_attention (sdpa backend and CP attention) to the stand-in.

    native_kernel: the modelled kernel (flex, varlen, flash) takes K/V at their own head count
    and packed-document masks as a block mask or cu_seqlens. Then the sdpa path's repeat of K/V
    to the query heads (done for cuDNN) is skipped, and no [B, 1, S, S] document mask is built
    or saved per layer (3.7 GiB for Qwen3-0.6B at batch 4 x 4096)."""
    global _native_kernel
    from torchtitan_ablate.models.common import attention

    orig = F.scaled_dot_product_attention, attention._repeat_kv, attention._dense_document_mask
    F.scaled_dot_product_attention = _fused_sdpa
    if native_kernel:
        _native_kernel = True
        attention._repeat_kv = lambda q, k, v: (q, k, v)
        # Shape-only: the stand-in never reads the mask.
        attention._dense_document_mask = lambda doc_BS: doc_BS.new_ones((1, 1, 1, 1), dtype=bool)
    try:
        yield
    finally:
        _native_kernel = False
        F.scaled_dot_product_attention, attention._repeat_kv, attention._dense_document_mask = orig
