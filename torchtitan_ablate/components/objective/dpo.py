"""Direct Preference Optimization: the loss on packed preference rows (data/preference.py).

Per micro-batch: the reference model's and the policy's per-token log-probabilities of the
labels (a loss head through the model's output projection, chunk by chunk: no [B, S, V]
logits), summed per document (chosen of pair k = document 2k, rejected = 2k + 1), then TRL's
DPOTrainer formulas per pair (trl/trainer/dpo_trainer.py, `_compute_loss`, TRL 1.16):
    chosen_logratios = logp(chosen) - ref_logp(chosen); likewise rejected
    delta = chosen_logratios - rejected_logratios
    sigmoid  -log sigmoid(beta * delta)
    robust   (-(1 - e) log sigmoid(beta * delta) + e log sigmoid(-beta * delta)) / (1 - 2e)
    ipo      (chosen_logratios / n_chosen - rejected_logratios / n_rejected - 1 / (2 beta))^2
             (n: response tokens, TRL's length normalisation)
    rewards/chosen = beta * chosen_logratios, rewards/rejected, rewards/margins (their
    difference), rewards/accuracies (chosen > rejected), logps/chosen, logps/rejected
The loss function returns sums over the micro-batch's pairs; train_step divides by the global
pair count (Run.loss_count), so every layout and accumulation gives the mean over the step's
pairs, as TRL's per-batch mean does for one batch.

Context and tensor parallel: each cp rank holds a slice of every row, each tp rank the tokens
of a contiguous slice of it (sequence parallel's, the labels'); the per-document sums are
all-reduced over the cp and tp groups (their backward sums the gradients too), so every rank
computes every pair's loss, and the pair count is summed over dp * cp * tp ranks to match.

Reference model (build.py builds it): a frozen copy of the starting weights sharded like the
policy, or with LoRA the policy itself inside `reference_context` (lora.adapters_off).
Shape legend: B batch, S sequence, N tokens (B * S), D model dim, V vocabulary, K pair slots.
"""

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from torchtitan_ablate.components.checkpoint.state import ModelWrapper
from torchtitan_ablate.components.objective.loss import IGNORE_INDEX
from torchtitan_ablate.config.dpo_config import DPO
from torchtitan_ablate.distributed.tensor_parallel import tp_shard_labels

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
REFERENCE_STATE = "dpo_reference"  # the copy's name in checkpoints


# ---- per-token log-probabilities ---------------------------------------------------------------


def _chunk_logps(logits_nV: torch.Tensor, labels_n: torch.Tensor) -> torch.Tensor:
    """log p(label) per token in float32, 0 where the label is ignored."""
    logits_nV = logits_nV.float()
    valid_n = labels_n != IGNORE_INDEX
    target_n1 = torch.where(valid_n, labels_n, 0).unsqueeze(1)
    target_logit_n = logits_nV.gather(1, target_n1).squeeze(1)
    return (target_logit_n - torch.logsumexp(logits_nV, dim=-1)) * valid_n


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """log p(labels | h) per token for h @ W^T, chunk by chunk, without the [N, V] logits.

    Unlike the cross-entropy sum (objective/loss.py), each token's output gradient is known
    only in backward (it depends on the pair's loss), so backward recomputes each chunk's
    logits: d logp / d logits = one_hot - softmax, scaled per token. Peak extra memory is one
    chunk's float32 logits, plus an fp32 grad_W [V, D] when W is trained.
    """

    @staticmethod
    def forward(ctx, h_ND, weight_VD, labels_BS, chunk_size: int):
        # [B, S] out, not a view of [N]: FSDP's hooks on the output head want a fresh tensor.
        logp_BS = torch.empty(labels_BS.shape, dtype=torch.float32, device=h_ND.device)
        logp_N, labels_N = logp_BS.view(-1), labels_BS.flatten()
        for start in range(0, h_ND.shape[0], chunk_size):
            end = start + chunk_size
            logp_N[start:end] = _chunk_logps(h_ND[start:end] @ weight_VD.T, labels_N[start:end])
        ctx.save_for_backward(h_ND, weight_VD, labels_N)
        ctx.chunk_size = chunk_size
        return logp_BS

    @staticmethod
    def backward(ctx, grad_BS):
        h_ND, weight_VD, labels_N = ctx.saved_tensors
        grad_N = grad_BS.flatten()
        want_w = ctx.needs_input_grad[1]  # False under LoRA: the output head is frozen
        grad_h_ND = torch.empty_like(h_ND)
        grad_w_VD = None  # fp32 [V, D]: only where the head trains (not under LoRA)
        if want_w:
            grad_w_VD = torch.zeros(weight_VD.shape, dtype=torch.float32, device=h_ND.device)
        for start in range(0, h_ND.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            h_nD, labels_n = h_ND[start:end], labels_N[start:end]
            valid_n = labels_n != IGNORE_INDEX
            g_n1 = (grad_N[start:end].float() * valid_n).unsqueeze(1)
            target_n1 = torch.where(valid_n, labels_n, 0).unsqueeze(1)
            probs_nV = torch.softmax((h_nD @ weight_VD.T).float(), dim=-1)
            grad_nV = probs_nV.mul_(-g_n1).scatter_add_(1, target_n1, g_n1).to(h_ND.dtype)
            grad_h_ND[start:end] = grad_nV @ weight_VD
            if want_w:
                grad_w_VD += (grad_nV.T @ h_nD).float()
        grad_w = grad_w_VD.to(weight_VD.dtype) if want_w else None
        return grad_h_ND, grad_w, None, None


def token_logps(
    h_BSD: torch.Tensor, weight_VD: torch.Tensor, labels_BS: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """Per-token log p(label) [B, S] (float32, 0 at ignored labels), chunk_size tokens at a
    time (0: all at once). A loss head for the model's forward: model(..., labels_BS=...,
    loss_head=partial(token_logps, chunk_size=c)) returns it from the gathered output weight."""
    h_ND = h_BSD.flatten(0, 1)
    chunk = chunk_size if chunk_size > 0 else max(h_ND.shape[0], 1)
    return _ChunkedTokenLogProbs.apply(h_ND, weight_VD, labels_BS, chunk)


# ---- per-sequence sums and the pair loss -------------------------------------------------------


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group; the backward sums the gradients over it too (every rank's loss
    depends on every rank's partial sums)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


def pair_sums(
    values_BS: torch.Tensor,
    document_ids_BS: torch.Tensor,
    groups: Sequence[dist.ProcessGroup] = (),
    row_len: int | None = None,
) -> torch.Tensor:
    """Sums of values per (row, document), as [B, K, 2]: [:, k, 0] chosen of pair k, [:, k, 1]
    its rejected (documents 2k and 2k + 1). K = ceil(row_len / 2) slots hold every document of
    a row of row_len tokens (each is at least two tokens long; default: the tokens given);
    slots past a row's pairs hold padding or nothing. With `groups` (the cp and tp ranks, each
    holding a slice of every row) the sums are of every rank's slice."""
    batch, seq = values_BS.shape
    slots = 2 * (((row_len or seq) + 1) // 2)
    index_N = (document_ids_BS.clamp(max=slots - 1) + slots * torch.arange(
        batch, device=values_BS.device
    ).unsqueeze(1)).flatten()  # fmt: skip
    sums = values_BS.new_zeros(batch * slots).index_add(0, index_N, values_BS.flatten())
    for group in groups:
        sums = _AllReduceSum.apply(sums, group)
    return sums.view(batch, slots // 2, 2)


def dpo_terms(
    policy_BK2: torch.Tensor,
    reference_BK2: torch.Tensor,
    tokens_BK2: torch.Tensor,
    settings: DPO,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss summed over the real pairs, and METRICS summed over them (detached)."""
    pair_K = (tokens_BK2 > 0).all(dim=-1)  # both sequences have response tokens: a real pair
    logratios_BK2 = policy_BK2 - reference_BK2
    chosen, rejected = logratios_BK2.unbind(-1)
    beta, eps = settings.beta, settings.label_smoothing
    delta = chosen - rejected
    if settings.loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif settings.loss_type == "robust":
        losses = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (
            1 - 2 * eps
        )
    else:  # ipo
        per_token = logratios_BK2 / tokens_BK2.clamp(min=1)
        losses = (per_token[..., 0] - per_token[..., 1] - 1 / (2 * beta)) ** 2
    mask = pair_K.to(losses.dtype)
    with torch.no_grad():
        r_chosen, r_rejected = beta * chosen, beta * rejected
        values = (
            r_chosen,
            r_rejected,
            (r_chosen > r_rejected).to(losses.dtype),
            r_chosen - r_rejected,
            policy_BK2[..., 0],
            policy_BK2[..., 1],
        )
        metrics = {name: (v * mask).sum() for name, v in zip(METRICS, values)}
    return (losses * mask).sum(), metrics


# ---- the loss function and the reference ---------------------------------------------------------


class DPOLoss:
    """loss_fn(model, micro_batch) -> (loss summed over its pairs, METRICS summed over them).

    reference: the frozen copy, or None to run `model` itself inside reference_context(model)
    (LoRA: adapters off) for the reference pass."""

    def __init__(
        self,
        settings: DPO,
        chunk_size: int,
        parallel_dims: Any | None,
        reference: nn.Module | None,
        reference_context: Callable[[nn.Module], AbstractContextManager] | None = None,
    ) -> None:
        assert (reference is None) != (reference_context is None)
        self.settings, self.chunk_size, pd = settings, chunk_size, parallel_dims
        self.reference, self.reference_context = reference, reference_context
        # Each cp rank holds a slice of every row (document ids too); each tp rank the logps of
        # a contiguous slice of its cp slice (the labels'), with the cp slice's document ids.
        # No parallel_dims: one process.
        self.cp, self.tp_mesh, self.groups = 1, None, []
        if pd is not None:
            self.cp = pd.cp
            self.tp_mesh = pd.mesh("tp") if pd.tp_enabled else None
            meshes = [name for name, on in (("cp", pd.cp_enabled), ("tp", pd.tp_enabled)) if on]
            self.groups = [pd.mesh(name).get_group() for name in meshes]

    def _pair_sums(self, values_BS: torch.Tensor, document_ids_BS: torch.Tensor) -> torch.Tensor:
        row_len = document_ids_BS.shape[1] * self.cp
        if self.tp_mesh is not None:
            document_ids_BS = tp_shard_labels(document_ids_BS, self.tp_mesh)
        return pair_sums(values_BS, document_ids_BS, self.groups, row_len)

    def head(self, h_BSD: torch.Tensor, weight_VD: torch.Tensor, labels_BS: torch.Tensor):
        return token_logps(h_BSD, weight_VD, labels_BS, self.chunk_size)

    def sequence_logps(self, model: nn.Module, batch: dict) -> torch.Tensor:
        logps_BS = model(
            batch["input_ids"],
            batch["positions"],
            batch["document_ids"],
            labels_BS=batch["labels"],
            loss_head=self.head,
        )
        return self._pair_sums(logps_BS, batch["document_ids"])

    def __call__(self, model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
        with torch.no_grad():  # the reference pass first: its activations are freed at once
            if self.reference is not None:
                reference_BK2 = self.sequence_logps(self.reference, batch)
            else:
                with self.reference_context(model):
                    reference_BK2 = self.sequence_logps(model, batch)
            valid_BS = (batch["labels"] != IGNORE_INDEX).float()
            tokens_BK2 = self._pair_sums(valid_BS, batch["document_ids"])
        policy_BK2 = self.sequence_logps(model, batch)
        return dpo_terms(policy_BK2, reference_BK2, tokens_BK2, self.settings)


def count_pairs(batch: dict) -> torch.Tensor:
    """The micro-batch's pairs: what the DPO loss sum is divided by (summed over ranks)."""
    return batch["num_pairs"].sum()


@torch.no_grad()
def init_reference(policy: nn.Module, reference: nn.Module) -> None:
    """Freezes the reference copy and gives it the policy's current weights (both sharded
    alike, so each rank copies its own shards). Called once built, and again by the trainer
    after the initial load (HF or DCP weights) of a fresh run."""
    for p_ref, p in zip(reference.parameters(), policy.parameters(), strict=True):
        p_ref.requires_grad_(False)
        p_ref.copy_(p)
    for b_ref, b in zip(reference.buffers(), policy.buffers(), strict=True):
        b_ref.copy_(b)


def reference_states(reference: nn.Module | None) -> dict[str, Any]:
    """Checkpoint entries for the reference copy (a resumed run keeps the starting weights
    whatever initial_load_path says by then); none without one."""
    return {} if reference is None else {REFERENCE_STATE: ModelWrapper([reference])}


def build_dpo_loss(
    settings: DPO,
    loss_chunk_size: int,
    parallel_dims: Any,
    policy: nn.Module,
    reference: nn.Module | None,
    reference_context: Callable[[nn.Module], AbstractContextManager],
) -> DPOLoss:
    """The DPO loss of a built run: with a reference copy (frozen here, given the policy's
    weights), else the policy inside reference_context for the reference pass.
    loss_chunk_size: tokens per chunk of the log-probability head (0 = all at once)."""
    if reference is None:
        return DPOLoss(settings, loss_chunk_size, parallel_dims, None, reference_context)
    init_reference(policy, reference)
    return DPOLoss(settings, loss_chunk_size, parallel_dims, reference)
