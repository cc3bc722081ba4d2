"""Token-choice top-k MoE layer (Qwen3-MoE): router, then the experts' route (experts.py).

The load-balancing loss enters training through the layer's own output: `_AttachAuxLoss` returns
the output unchanged and, in backward, hands the aux loss a gradient of `aux_loss_scale` (set by
the trainer: 1 / (micro-batches * dp * cp * tp)). Adding it to the final loss instead would send
its gradient to every layer's router as soon as backward starts, which makes full activation
checkpointing recompute all layers at once (30B-A3B, EP 8: 30 GiB instead of 14 per GPU).
Exposed for metrics: `aux_loss` (last forward's coefficient-scaled value, detached),
`tokens_per_expert` (float counts accumulated since the last reset) and, when enabled, the
aux-loss-free `expert_bias` (DeepSeek-V3) that shifts expert *selection* only.

`force_load_balance` (debug.moe_force_load_balance, benchmarks only) replaces the router's choice
by round-robin slots, as torchtitan's `_debug_force_load_balance`: every expert gets T*K/E rows
(floor or ceil), computed on the device from the token count alone.

Shape legend: B batch, S sequence, D model dim, T = B*S tokens, E experts, K top_k,
R = T*K routed rows.
"""

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_ablate.models.common.experts import GroupedExperts
from torchtitan_ablate.models.common.init import ParamInit, init_for

Slot = TypeVar("Slot", int, torch.Tensor)


def _as_is(weight: torch.Tensor) -> torch.Tensor:
    return weight


class TopKRouter(nn.Module):
    """Softmax over experts in float32, top-k, optional renormalisation of the k weights.

    force_load_balance: benchmark only; the experts are round-robin slots
    (`round_robin_expert`) instead of the top-k, and the weights the chosen experts' softmax
    probabilities (renormalised as usual), as in torchtitan's debug routing."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        force_load_balance: bool = False,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.force_load_balance = force_load_balance
        # The gate weight as the router computes with it: the parameter itself (tensor parallel
        # swaps in the local copy of its replicated DTensor, tensor_parallel.py).
        self.gate_weight_fn: Callable[[torch.Tensor], torch.Tensor] = _as_is

    def forward(
        self, x_TD: torch.Tensor, expert_bias_E: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (probs_TE float32, weights_TK float32, experts_TK int64)."""
        # Logits in float32 whatever the parameter dtype (bf16 under FSDP mixed precision):
        # near-ties between experts decide routing.
        logits_TE = F.linear(x_TD.float(), self.gate_weight_fn(self.gate.weight).float())
        probs_TE = logits_TE.softmax(dim=-1)
        if self.force_load_balance:
            n_tokens = x_TD.shape[0]
            slot_R = torch.arange(n_tokens * self.top_k, device=x_TD.device) % self.num_experts
            experts_TK = round_robin_expert(slot_R, self.num_experts, self.top_k)
            experts_TK = experts_TK.view(n_tokens, self.top_k)
        else:
            scores_TE = probs_TE if expert_bias_E is None else probs_TE + expert_bias_E
            experts_TK = scores_TE.topk(self.top_k, dim=-1).indices
        weights_TK = probs_TE.gather(1, experts_TK)  # the bias never reaches the weights
        if self.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return probs_TE, weights_TK, experts_TK


def round_robin_expert(slot: Slot, num_experts: int, top_k: int) -> Slot:
    """The expert of round-robin slot `slot` in [0, E) (an int, or an int64 tensor of them).

    Token t fills slots t*K .. t*K + K - 1 (mod E), so each expert gets T*K/E rows (floor or
    ceil), as in torchtitan's debug routing. Its slot -> expert map is the identity; here a
    permutation takes consecutive slots to experts E/K apart, so a token's K experts spread
    over the expert-parallel ranks (a token reaches min(ranks, K) of them when K divides E)
    instead of sitting on one rank, which would make token dispatch look cheaper than under any
    learned routing. Slots of residue r = slot % K fill experts [offset_r, offset_r + count_r),
    count_r = ceil((E - r) / K)."""
    residue = slot % top_k
    extra = num_experts % top_k  # residues below it have one slot more
    if isinstance(residue, torch.Tensor):
        before = residue.clamp(max=extra)
    else:
        before = min(residue, extra)
    return residue * (num_experts // top_k) + before + slot // top_k


class _AttachAuxLoss(torch.autograd.Function):
    """y in forward; in backward, y's gradient passes through and aux_loss gets `scale`."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux_loss.shape, aux_loss.dtype, aux_loss.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad_y, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class MoE(nn.Module):
    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool = True,
        aux_loss_coef: float = 0.0,
        use_expert_bias: bool = False,
        grouped_mm: bool | None = None,
        force_load_balance: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.aux_loss_coef = aux_loss_coef
        self.router = TopKRouter(dim, num_experts, top_k, norm_topk_prob, force_load_balance)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, grouped_mm)
        # Metric state, not model state: not saved in checkpoints.
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)
        # Learned (non-gradient) state when enabled, so checkpointed.
        self.expert_bias: torch.Tensor | None
        if use_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts))
        else:
            self.expert_bias = None
        self.aux_loss: torch.Tensor | None = None
        self.aux_loss_scale = 1.0

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        probs_TE, weights_TK, experts_TK = self.router(x_TD, self.expert_bias)

        # Count assignments with scatter_add (bincount would sync with the host on CUDA).
        experts_R = experts_TK.flatten()
        counts_E = torch.zeros(self.num_experts, dtype=torch.int64, device=x_TD.device)
        counts_E.scatter_add_(0, experts_R, torch.ones_like(experts_R))
        with torch.no_grad():
            # Under full activation checkpointing the recompute counts twice; harmless, since the
            # metrics (max/mean) and the bias update (sign of mean - load) are scale-free.
            self.tokens_per_expert.add_(counts_E)
        aux_loss = self._aux_loss(probs_TE, counts_E) if self.aux_loss_coef > 0 else None
        self.aux_loss = None if aux_loss is None else aux_loss.detach()

        y_BSD = self.experts.route(x_TD, experts_TK, weights_TK, counts_E).view_as(x_BSD)
        if aux_loss is not None and torch.is_grad_enabled():
            y_BSD = _AttachAuxLoss.apply(y_BSD, aux_loss, self.aux_loss_scale)
        return y_BSD

    def _aux_loss(self, probs_TE: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        # Switch/Qwen3 load balancing, as HF's load_balancing_loss_func for one layer:
        # E * sum_e f_e * P_e, f_e = assignments to e / tokens (sums to K), P_e = mean prob of e.
        n_tokens = probs_TE.shape[0]
        frac_E = counts_E.float() / n_tokens
        mean_prob_E = probs_TE.mean(dim=0)
        return self.aux_loss_coef * self.num_experts * (frac_E * mean_prob_E).sum()

    @torch.no_grad()
    def update_expert_bias(self, rate: float, load_E: torch.Tensor | None = None) -> None:
        """bias += rate * (sign(mean load - load), less its mean), torchtitan's rule. The
        selection depends only on differences between the biases, which the mean leaves alone;
        without it the bias drifts by up to `rate` a step. load_E defaults to the counts
        accumulated since the last reset. With data parallelism pass counts summed over ranks,
        or the ranks' biases drift apart. Counts are not reset here (the metrics read them too).
        """
        if self.expert_bias is None:
            raise ValueError(
                "update_expert_bias needs the model built with moe_bias_update_rate > 0"
            )
        load_E = self.tokens_per_expert if load_E is None else load_E
        step_E = torch.sign(load_E.mean() - load_E)
        self.expert_bias.add_(rate * (step_E - step_E.mean()))

    def reset_expert_load(self) -> None:
        self.tokens_per_expert.zero_()

    def init_weights(self, init_std: float, init: ParamInit | None = None) -> None:
        init = init_for(self, init)
        # The block's depth-scaled std, as torchtitan: flatter softmax at init, so the expert
        # bias (steps of moe_bias_update_rate) moves the selection within a few steps.
        init.trunc_normal_(self.router.gate.weight, init_std)
        self.experts.init_weights(init_std, init)
        self.tokens_per_expert.zero_()
        if self.expert_bias is not None:
            self.expert_bias.zero_()
