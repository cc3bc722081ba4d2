"""What differs on CUDA from the fake-cpu program, and how the estimate accounts for it.

Each adjustment is listed (with its reason) in docs/memory_estimation.md:

1. dtypes: the CPU trainer computes in float32 unless `training.cpu_mixed_precision`; CUDA uses
   `training.mixed_precision_param` (bf16). The estimate sets cpu_mixed_precision, so FSDP's
   MixedPrecisionPolicy is the CUDA one.
2. optimizer: `optimizer.implementation = auto` is fused on CUDA (no per-step temporaries) and
   foreach on CPU; the estimate builds the optimizer for "cuda".
3. routed experts: CUDA bf16 runs `torch._grouped_mm` on rows padded per expert; the estimate
   forces that path (`build.BuildOptions.moe_grouped_mm`), which has a CPU meta kernel.
4. attention: CUDA's cuDNN / flash / FlexAttention kernels save only q, k, v, out and the
   log-sum-exp (float32 [B, H, S]) for backward, plus the additive bias when a dense mask is
   given (SDPA turns a bool mask into a bias of the query dtype for cuDNN / efficient
   attention); their backward holds a float32 dq accumulator. `cuda_attention` installs, through
   attention.py's `dense_kernel_with`, a stand-in with exactly those tensors. For the kernels
   that take GQA and document masks natively (flex, the CUDA choice of attn_backend "auto";
   varlen; flash) K/V stay at kv heads and no dense mask exists.
5. loss_impl liger / cce: Triton kernels (optional packages); kernel_loss.py installs, through
   loss.py's `kernel_loss_with`, stand-ins with the tensors the packages allocate and save.
6. caching allocator: every block is rounded up to 512 bytes (`ROUND_BYTES`).
7. CUDA context + NCCL communicators: a constant reported separately (`context_gib`).
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


# The stand-in is a custom op, opaque to torch.compile: AOTAutograd's partitioner would
# recompute an empty_like output instead of saving it, where the real kernel's out and lse are
# outputs it must keep. Shapes only: values are never computed (fake tensors).
@torch.library.custom_op("ttablate_memory::fused_attention", mutates_args=())
def _fused_attention(
    q_BHLK: torch.Tensor, k_BJSK: torch.Tensor, v_BJSK: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The real kernels (flex, flash, cuDNN) write out in the query's memory layout: the model's
    # [B, S, H, K] projection viewed as [B, H, S, K]. Then out's transpose back to [B, S, H * K]
    # for the output projection is a view; a [B, H, S, K]-contiguous out would make it a copy,
    # saved for backward beside out (one [tokens, H * K] tensor per layer too many).
    physical = sorted(range(q_BHLK.dim()), key=lambda d: -q_BHLK.stride(d))
    out_BHLK = torch.empty_permuted(
        q_BHLK.shape[:-1] + (v_BJSK.shape[-1],), physical, dtype=q_BHLK.dtype, device=q_BHLK.device
    )
    lse_BHL = q_BHLK.new_empty(q_BHLK.shape[:-1], dtype=torch.float32)
    # The additive bias SDPA makes of a dense mask for cuDNN / efficient attention (empty else).
    shape = mask.shape if mask is not None else (0,)
    bias = q_BHLK.new_empty(shape)
    return out_BHLK, lse_BHL, bias


@torch.library.custom_op("ttablate_memory::fused_attention_backward", mutates_args=())
def _fused_attention_backward(
    grad_out_BHLK: torch.Tensor,
    q_BHLK: torch.Tensor,
    k_BJSK: torch.Tensor,
    v_BJSK: torch.Tensor,
    out_BHLK: torch.Tensor,
    lse_BHL: torch.Tensor,
    bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # The kernel's float32 dq accumulator is returned (and dropped) so that it is counted.
    dq_accum_BHLK = q_BHLK.new_empty(q_BHLK.shape, dtype=torch.float32)
    return (
        torch.empty_like(q_BHLK),
        torch.empty_like(k_BJSK),
        torch.empty_like(v_BJSK),
        dq_accum_BHLK,
    )


_fused_attention.register_fake(_fused_attention._init_fn)
_fused_attention_backward.register_fake(_fused_attention_backward._init_fn)


def _setup_context(ctx, inputs, output) -> None:
    q_BHLK, k_BJSK, v_BJSK, _ = inputs
    out_BHLK, lse_BHL, bias = output
    ctx.save_for_backward(q_BHLK, k_BJSK, v_BJSK, out_BHLK, lse_BHL, bias)


def _backward(ctx, grad_out_BHLK, _grad_lse, _grad_bias):
    dq, dk, dv, _ = _fused_attention_backward(grad_out_BHLK, *ctx.saved_tensors)
    return dq, dk, dv, None


_fused_attention.register_autograd(_backward, setup_context=_setup_context)


class _FusedKernelStandIn(DenseKernel):
    """Dense attention as CUDA's fused kernels run it, shapes only (attention.py's seam)."""

    def __init__(self, native_gqa_and_documents: bool) -> None:
        self.native_gqa_and_documents = native_gqa_and_documents

    def __call__(self, q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
        mask = None if self.native_gqa_and_documents else attn_mask
        return _fused_attention(q, k, v, mask)[0]


@contextmanager
def cuda_attention(native_kernel: bool) -> Iterator[None]:
    """Runs the sdpa backend and CP attention through the fused-kernel stand-in.

    native_kernel: the modelled kernel (flex, varlen, flash) takes K/V at their own head count
    and packed-document masks as a block mask or cu_seqlens. Then the sdpa path's repeat of K/V
    to the query heads (done for cuDNN) is skipped, and no [B, 1, S, S] document mask is built
    or saved per layer (3.7 GiB for Qwen3-0.6B at batch 4 x 4096)."""
    with dense_kernel_with(_FusedKernelStandIn(native_kernel)):
        yield
