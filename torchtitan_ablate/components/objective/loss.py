"""Token cross-entropy as a sum; the trainer divides by the global count of valid tokens so
that gradient accumulation and every data-parallel layout give the same gradient.

Loss heads (training.loss_impl): a loss head takes the final hidden states [B, S, D], the output
weight [V, D] and the labels [B, S] and returns the float32 cross-entropy sum without the caller
building the logits. The model's output head calls it inside its own forward, where FSDP has
gathered the weight. chunked is this engine's; liger and cce are Liger-Kernel's fused linear
cross-entropy and Apple's cut cross-entropy (Triton kernels; optional packages).
"""

import functools
import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from torchtitan_ablate.config.errors import ConfigError
from torchtitan_ablate.models.common.output_head import LossHead

IGNORE_INDEX = -100  # labels the loss skips (padding, prompts in SFT): torch's default


def cross_entropy_sum(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy (float32) over labels != IGNORE_INDEX."""
    return F.cross_entropy(
        logits_BSV.flatten(0, 1).float(),
        labels_BS.flatten(0, 1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def num_valid_tokens(labels_BS: torch.Tensor) -> torch.Tensor:
    return (labels_BS != IGNORE_INDEX).sum()


def count_valid_tokens(batch: dict) -> torch.Tensor:
    """A micro-batch's count that the token loss's sum is divided by (DPO's: dpo.count_pairs)."""
    return num_valid_tokens(batch["labels"])


def _chunk_loss_and_grad(
    logits_nV: torch.Tensor, labels_n: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's CE sum (float32) and d loss / d logits = softmax - one_hot, zero for ignored
    tokens, in the logits' dtype. Eager version: everything happens in place on one float32
    copy of the logits (the matmul output is this function's own), with explicit max/exp/sum
    rather than logsumexp, whose temporaries differ between devices and the memory estimator."""
    out_dtype = logits_nV.dtype
    logits_nV = logits_nV.float()
    valid_n = labels_n != IGNORE_INDEX
    target_n = torch.where(valid_n, labels_n, 0).unsqueeze(1)
    max_n1 = logits_nV.amax(dim=-1, keepdim=True)
    target_logit_n = logits_nV.gather(1, target_n).squeeze(1)
    probs_nV = logits_nV.sub_(max_n1).exp_()  # unnormalised
    sum_n1 = probs_nV.sum(dim=-1, keepdim=True)
    lse_n = (sum_n1.log() + max_n1).squeeze(1)
    loss = ((lse_n - target_logit_n) * valid_n).sum()
    grad_nV = probs_nV.div_(sum_n1)
    grad_nV.scatter_add_(1, target_n, torch.full_like(target_n, -1, dtype=grad_nV.dtype))
    return loss, grad_nV.mul_(valid_n.unsqueeze(1)).to(out_dtype)


def _chunk_loss_and_grad_fusable(
    logits_nV: torch.Tensor, labels_n: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as pure reductions and pointwise ops (the one-hot as an index comparison, not a
    scatter), which torch.compile turns into two passes over the chunk's logits with no float32
    copy of them; eager, it would allocate several float32 temporaries."""
    out_dtype = logits_nV.dtype
    logits_nV = logits_nV.float()
    valid_n = labels_n != IGNORE_INDEX
    target_n = torch.where(valid_n, labels_n, 0)
    lse_n = torch.logsumexp(logits_nV, dim=-1)
    target_logit_n = logits_nV.gather(1, target_n.unsqueeze(1)).squeeze(1)
    loss = ((lse_n - target_logit_n) * valid_n).sum()
    is_target_nV = torch.arange(logits_nV.shape[1], device=logits_nV.device) == target_n[:, None]
    grad_nV = torch.exp(logits_nV - lse_n.unsqueeze(1)) - is_target_nV.float()
    return loss, (grad_nV * valid_n.unsqueeze(1)).to(out_dtype)


@functools.cache
def _compiled_chunk_loss_and_grad(backend: str | Callable = "inductor"):
    return torch.compile(_chunk_loss_and_grad_fusable, backend=backend)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum CE(h @ W^T, labels) without materialising the [N, V] logits of the whole batch.

    Forward walks over token chunks: logits of one chunk (in W's dtype, upcast to fp32 as the
    plain path does), their log-sum-exp and target logit, and at once the gradients w.r.t. the
    chunk's hidden states and W (softmax - one-hot), which backward only scales. Peak extra
    memory is one chunk's logits plus grad_h [N, D] and an fp32 grad_W [V, D], instead of the
    fp32 logits and their gradient for every token (for Qwen3's 151,936-word vocab, the largest
    activation); the FLOPs are the same as the plain path's.
    """

    @staticmethod
    def forward(ctx, h_ND, weight_VD, labels_N, chunk_size: int, compiled: bool, backend):
        chunk_fn = _compiled_chunk_loss_and_grad(backend) if compiled else _chunk_loss_and_grad
        n_tokens = h_ND.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        grad_h_ND = torch.empty_like(h_ND)
        grad_w_VD = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device)
        for start in range(0, n_tokens, chunk_size):
            h_nD = h_ND[start : start + chunk_size]
            labels_n = labels_N[start : start + chunk_size]
            chunk_loss, grad_nV = chunk_fn(h_nD @ weight_VD.T, labels_n)
            loss += chunk_loss
            grad_h_ND[start : start + chunk_size] = grad_nV @ weight_VD
            grad_w_VD += (grad_nV.T @ h_nD).float()
        ctx.save_for_backward(grad_h_ND, grad_w_VD.to(weight_VD.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h_ND, grad_w_VD = ctx.saved_tensors
        grad_h = grad_h_ND * grad_loss.to(grad_h_ND.dtype)
        return grad_h, grad_w_VD * grad_loss, None, None, None, None


def chunked_linear_cross_entropy_sum(
    h_BSD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_BS: torch.Tensor,
    chunk_size: int,
    compiled: bool = False,
    backend: str | Callable = "inductor",
) -> torch.Tensor:
    """Same value and gradients as cross_entropy_sum(h @ weight^T, labels), chunk by chunk.
    compiled: fuse each chunk's softmax and gradient with torch.compile (on `backend`)."""
    if not torch.is_grad_enabled():  # validation: the loss alone, no gradients made ahead
        h_ND, labels_N = h_BSD.flatten(0, 1), labels_BS.flatten(0, 1)
        loss = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        for i in range(0, h_ND.shape[0], chunk_size):
            logits_1nV = (h_ND[i : i + chunk_size] @ weight_VD.T)[None]
            loss += cross_entropy_sum(logits_1nV, labels_N[i : i + chunk_size][None])
        return loss
    return _ChunkedLinearCrossEntropy.apply(
        h_BSD.flatten(0, 1), weight_VD, labels_BS.flatten(0, 1), chunk_size, compiled, backend
    )


# loss_impl -> (module, pip extra of this package, package on PyPI)
KERNEL_LOSSES = {
    "liger": ("liger_kernel", "liger", "liger-kernel"),
    "cce": ("cut_cross_entropy", "cce", "cut-cross-entropy"),
}


def chunked_loss_head(
    chunk_size: int, compiled: bool = False, backend: str | Callable = "inductor"
) -> LossHead:
    return functools.partial(
        chunked_linear_cross_entropy_sum, chunk_size=chunk_size, compiled=compiled, backend=backend
    )


def _liger_sum(h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    # float32 accumulation of the weight gradient, as the chunked loss does; the other options
    # keep Liger's defaults: no label smoothing, z-loss (lse_square_scale) 0, no softcap.
    return liger_fused_linear_cross_entropy(
        h_ND, weight_VD, labels_N, ignore_index=IGNORE_INDEX, reduction="sum",
        accum_dtype=torch.float32,
    )  # fmt: skip


def _cce_sum(h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    from cut_cross_entropy import linear_cross_entropy

    needs_grad = h_ND.requires_grad or weight_VD.requires_grad
    if needs_grad and h_ND.dtype not in (torch.bfloat16, torch.float16):
        # cut-cross-entropy's backward asserts on this, after the whole forward.
        raise ConfigError(
            "training.loss_impl = 'cce' trains bf16/fp16 hidden states only (its backward), not "
            f"{h_ND.dtype}: set training.mixed_precision_param = 'bfloat16' or use loss_impl = "
            "'liger' or 'chunked'"
        )
    # The package's defaults, stated: the loss is exact (fp32 log-sum-exp), the gradients are
    # not: filter_eps="high" skips blocks of softmax - onehot entries all below bf16 eps / 32,
    # and its kernel sums the gradient blocks in bf16 (docs/performance.md has the figures).
    return linear_cross_entropy(
        h_ND, weight_VD, labels_N, ignore_index=IGNORE_INDEX, reduction="sum", filter_eps="high",
        impl="cce",
    )  # fmt: skip


KernelLossSum = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(h_ND, weight_VD, labels_N) -> cross-entropy sum: the kernel call of a liger or cce head."""

_stand_ins: dict[str, KernelLossSum] = {}


@contextmanager
def kernel_loss_with(stand_ins: dict[str, KernelLossSum]) -> Iterator[None]:
    """Runs the loss heads of the loss_impls named in `stand_ins` through their stand-ins
    instead of the packages' kernels, for heads built during the context (the memory
    estimator's seam: it models their allocations on fake CPU tensors). No kernel runs then,
    so check_kernel_loss asks for neither the package nor CUDA."""
    saved = dict(_stand_ins)
    _stand_ins.update(stand_ins)
    try:
        yield
    finally:
        _stand_ins.clear()
        _stand_ins.update(saved)


def check_kernel_loss(impl: str) -> None:
    """ConfigError (one line) unless loss_impl `impl`'s package is installed and CUDA is here
    (or a stand-in runs instead of the kernel: kernel_loss_with)."""
    if impl in _stand_ins:
        return
    module, extra, package = KERNEL_LOSSES[impl]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"training.loss_impl = {impl!r} needs the {package} package: pip install -e .[{extra}]"
            " (or use loss_impl = 'chunked')"
        )
    if not torch.cuda.is_available():
        raise ConfigError(
            f"training.loss_impl = {impl!r} needs CUDA (a Triton kernel) and no GPU is visible; "
            "use loss_impl = 'chunked' or 'plain'"
        )


def kernel_loss_head(impl: str) -> LossHead:
    """The liger or cce loss head (check_kernel_loss first); its stand-in where one is installed
    (kernel_loss_with)."""
    stand_in = _stand_ins.get(impl)
    fn = stand_in or (_liger_sum if impl == "liger" else _cce_sum)

    def head(h_BSD: torch.Tensor, weight_VD: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        if stand_in is None and h_BSD.device.type != "cuda":
            raise ConfigError(
                f"training.loss_impl = {impl!r} is a CUDA kernel: it cannot run on "
                f"{h_BSD.device.type} tensors; use loss_impl = 'chunked' or 'plain'"
            )
        return fn(h_BSD.flatten(0, 1), weight_VD, labels_BS.flatten(0, 1)).float()

    return head
