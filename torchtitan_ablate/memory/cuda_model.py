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
   attention); their backward holds a float32 dq accumulator. `cuda_attention` installs, through
   attention.py's `dense_kernel_with`, a stand-in with exactly those tensors. For the kernels
   that take GQA and document masks natively (flex, the CUDA choice of attn_backend "auto";
   varlen; flash) K/V stay at kv heads and no dense mask exists.
5. caching allocator: every block is rounded up to 512 bytes (`ROUND_BYTES`).
6. CUDA context + NCCL communicators: a constant reported separately (`context_gib`).
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from torchtitan_ablate.models.common.attention import DenseKernel, dense_kernel_with

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


class _FusedKernelStandIn(DenseKernel):
    """Dense attention as CUDA's fused kernels run it, shapes only (attention.py's seam)."""

    def __init__(self, native_gqa_and_documents: bool) -> None:
        self.native_gqa_and_documents = native_gqa_and_documents

    def __call__(self, q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
        mask = None if self.native_gqa_and_documents else attn_mask
        return _FusedAttention.apply(q, k, v, mask)


@contextmanager
def cuda_attention(native_kernel: bool) -> Iterator[None]:
    """Runs the sdpa backend and CP attention through the fused-kernel stand-in.

    native_kernel: the modelled kernel (flex, varlen, flash) takes K/V at their own head count
    and packed-document masks as a block mask or cu_seqlens. Then the sdpa path's repeat of K/V
    to the query heads (done for cuDNN) is skipped, and no [B, 1, S, S] document mask is built
    or saved per layer (3.7 GiB for Qwen3-0.6B at batch 4 x 4096)."""
    with dense_kernel_with(_FusedKernelStandIn(native_kernel)):
        yield
