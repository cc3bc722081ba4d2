"""Stand-ins for the Triton loss kernels (training.loss_impl "liger" and "cce"), shapes only.

Neither package nor CUDA is needed to estimate them: `cuda_kernel_losses` installs, through
objective/loss.py's `kernel_loss_with`, autograd Functions that allocate, save and free exactly
the tensors the packages' code does around its kernels (liger-kernel 0.8.5's
fused_linear_cross_entropy.py, cut-cross-entropy 25.1.1's cce.py / cce_lse_forward.py /
cce_backward.py), with the arguments our call sites pass (loss.py's `_liger_sum`, `_cce_sum`).
The kernels themselves write only into those tensors. Values are never computed: the estimator
runs them on fake tensors.
"""

import math
from contextlib import AbstractContextManager

import torch

from torchtitan_ablate.components.objective.loss import IGNORE_INDEX, kernel_loss_with


def liger_chunk_size(n_tokens: int, dim: int, vocab: int) -> int:
    """Tokens per chunk of Liger's forward: the transient logits [chunk, V] are kept to about
    the size of the input [N, D] (its chunk_mem_const 1), rounded up to a power of 2."""
    inc_factor = math.ceil(vocab / dim)
    chunk = 1 << max(math.ceil(n_tokens / inc_factor) - 1, 0).bit_length()
    return min(chunk, n_tokens)


class _LigerFusedLinearCrossEntropy(torch.autograd.Function):
    """Liger's forward computes both gradients chunk by chunk; backward only scales them in place
    (a Triton kernel) and returns the saved tensors themselves."""

    @staticmethod
    def forward(ctx, h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor):
        n_tokens, dim = h_ND.shape
        vocab = weight_VD.shape[0]
        grad_h_ND = torch.zeros_like(h_ND)
        # accum_dtype=float32 (our call): the weight gradient accumulates in an fp32 buffer;
        # none for a frozen weight (LoRA) or when h needs no gradient.
        with_w = ctx.needs_input_grad[0] and ctx.needs_input_grad[1]
        grad_w_VD = torch.zeros_like(weight_VD, dtype=torch.float32) if with_w else None
        loss_N = h_ND.new_zeros((n_tokens,), dtype=torch.float32)
        valid_N = labels_N != IGNORE_INDEX  # counted with .item(); alive to the end
        valid_N.sum()
        # Grad mode is off inside forward, so (CUDA, equal bf16 dtypes) every chunk's matmul
        # writes into one logits buffer, overwritten in place by the logits' gradient, and
        # both gradient matmuls write into grad_h / grad_w (out=): nothing else per chunk.
        logits_cV = h_ND.new_empty((liger_chunk_size(n_tokens, dim, vocab), vocab))
        del logits_cV  # freed before the weight gradient's cast
        loss = loss_N.sum()
        if with_w:  # the fp32 buffer is freed only after the cast
            grad_w_VD = grad_w_VD.to(weight_VD.dtype)
        ctx.save_for_backward(grad_h_ND, grad_w_VD)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h_ND, grad_w_VD = ctx.saved_tensors
        grad_w_VD = grad_w_VD.mul_(grad_loss) if grad_w_VD is not None else None
        return grad_h_ND.mul_(grad_loss), grad_w_VD, None


def liger_sum(h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    return _LigerFusedLinearCrossEntropy.apply(h_ND, weight_VD, labels_N)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _CutCrossEntropy(torch.autograd.Function):
    """cut cross-entropy (impl "cce", filter_eps "high", reduction "sum"): forward keeps the
    log-sum-exp and the vocabulary's mean logit (the gradient filter's block order); backward
    recomputes the logits block by block into bf16 gradients of h and W."""

    @staticmethod
    def forward(ctx, h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor):
        n_tokens, vocab = h_ND.shape[0], weight_VD.shape[0]
        lse_N = h_ND.new_full((n_tokens,), -math.inf, dtype=torch.float32)
        locks = h_ND.new_zeros((_cdiv(n_tokens, 128),), dtype=torch.int32)  # uint32 there
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        logit_avg_V = h_ND.new_zeros((vocab,), dtype=torch.float32) if needs_grad else None
        neg_dot_N = h_ND.new_zeros((n_tokens,), dtype=torch.float32)
        loss = neg_dot_N.add_(lse_N).sum()
        del locks
        ctx.save_for_backward(h_ND, weight_VD, lse_N, labels_N, logit_avg_V)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        h_ND, weight_VD, lse_N, _, logit_avg_V = ctx.saved_tensors
        vocab_order_V = torch.argsort(logit_avg_V).to(torch.int32)
        grad_h_ND = torch.zeros_like(h_ND)
        # The kernel accumulates dW in h's dtype (bf16), then casts to W's dtype if it differs;
        # none for a frozen weight (LoRA).
        with_w = ctx.needs_input_grad[1]
        grad_w_VD = torch.zeros_like(weight_VD, dtype=h_ND.dtype) if with_w else None
        n_locks = _cdiv(h_ND.shape[1], 64)
        de_locks = h_ND.new_zeros((_cdiv(h_ND.shape[0], n_locks), n_locks), dtype=torch.int32)
        dc_locks = h_ND.new_zeros((_cdiv(weight_VD.shape[0], n_locks), n_locks), dtype=torch.int32)
        del vocab_order_V, de_locks, dc_locks
        return grad_h_ND, grad_w_VD.to(weight_VD.dtype) if with_w else None, None


def cce_sum(h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    # The package's wrapper first indexes the valid tokens: (labels != ignore).nonzero() as
    # int64 [N, 1], cast to int32; dropped when every label counts (the estimator's synthetic
    # batches), else kept for the kernels ([valid] int32, a few bytes per token).
    valid_N = labels_N != IGNORE_INDEX
    index_N1 = torch.empty((labels_N.shape[0], 1), dtype=torch.int64, device=valid_N.device)
    index_N1 = index_N1.to(torch.int32)
    del valid_N, index_N1
    return _CutCrossEntropy.apply(h_ND, weight_VD, labels_N)


def cuda_kernel_losses() -> AbstractContextManager:
    """loss_impl "liger" and "cce" run through the stand-ins (loss.py's seam)."""
    return kernel_loss_with({"liger": liger_sum, "cce": cce_sum})
