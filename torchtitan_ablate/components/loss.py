"""Token cross-entropy as a sum; the trainer divides by the global count of valid tokens so
that gradient accumulation and every data-parallel layout give the same gradient."""

import functools

import torch
import torch.nn.functional as F

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
def _compiled_chunk_loss_and_grad():
    return torch.compile(_chunk_loss_and_grad_fusable)


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
    def forward(ctx, h_ND, weight_VD, labels_N, chunk_size: int, compiled: bool):
        chunk_fn = _compiled_chunk_loss_and_grad() if compiled else _chunk_loss_and_grad
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
        return grad_h_ND * grad_loss.to(grad_h_ND.dtype), grad_w_VD * grad_loss, None, None, None


def chunked_linear_cross_entropy_sum(
    h_BSD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_BS: torch.Tensor,
    chunk_size: int,
    compiled: bool = False,
) -> torch.Tensor:
    """Same value and gradients as cross_entropy_sum(h @ weight^T, labels), chunk by chunk.
    compiled: fuse each chunk's softmax and gradient with torch.compile."""
    if not torch.is_grad_enabled():  # validation: the loss alone, no gradients made ahead
        h_ND, labels_N = h_BSD.flatten(0, 1), labels_BS.flatten(0, 1)
        loss = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        for i in range(0, h_ND.shape[0], chunk_size):
            logits_1nV = (h_ND[i : i + chunk_size] @ weight_VD.T)[None]
            loss += cross_entropy_sum(logits_1nV, labels_N[i : i + chunk_size][None])
        return loss
    return _ChunkedLinearCrossEntropy.apply(
        h_BSD.flatten(0, 1), weight_VD, labels_BS.flatten(0, 1), chunk_size, compiled
    )
