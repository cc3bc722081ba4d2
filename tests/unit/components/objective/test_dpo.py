"""DPO loss: equal to TRL's DPOTrainer computation, packed or padded, chunked or not.

The reference is TRL 1.16's `DPOTrainer._compute_loss` (trl/trainer/dpo_trainer.py), written
out below on transformers' Qwen3ForCausalLM with the same weights (trl itself needs accelerate
and datasets, which this project does not install): the batch is [chosen rows; rejected rows],
each row prompt + completion right-padded, `completion_mask` marking the completion; per-token
log-probs of input_ids[1:] under logits[:-1], summed where completion_mask[1:] is set; then the
sigmoid / robust / ipo formulas and the rewards/* and logps/* metrics as means over the pairs.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from torchtitan_ablate.components.data.preference import pair_row
from torchtitan_ablate.components.objective.dpo import METRICS, DPOLoss, token_logps
from torchtitan_ablate.config.dpo_config import DPO
from torchtitan_ablate.models.common.lora import adapters_off, apply_lora
from torchtitan_ablate.models.qwen3 import Qwen3Model, Qwen3ModelArgs, Qwen3StateDictAdapter

VOCAB, SEQ = 96, 64
PAIRS = [  # (prompt, chosen, rejected) token ids
    ([5, 9, 14, 3], [22, 7, 40], [41, 8]),
    ([17, 2], [33, 34, 35, 36, 1], [60, 61, 62]),
    ([70, 71, 72, 73, 74], [10], [11, 12, 13, 15]),
]


def hf_model(seed: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=48, max_position_embeddings=SEQ,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
        attn_implementation="eager",
    )  # fmt: skip
    model = Qwen3ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights that give log-probs well away from uniform
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.3 * noise)
    return model


def ours(hf: Qwen3ForCausalLM) -> tuple[Qwen3Model, Qwen3StateDictAdapter]:
    args = Qwen3ModelArgs.from_hf_config(hf.config.to_dict())
    adapter = Qwen3StateDictAdapter(args)
    model = Qwen3Model(args)
    model.load_state_dict(adapter.from_hf(hf.state_dict()), strict=True)
    return model, adapter


def trl_reference(policy, reference, settings: DPO) -> tuple[torch.Tensor, dict]:
    """TRL's concatenated forward and loss (see the module docstring)."""
    rows, masks = [], []
    for which in (1, 2):  # chosen rows, then rejected rows
        for pair in PAIRS:
            rows.append(pair[0] + pair[which])
            masks.append([0] * len(pair[0]) + [1] * len(pair[which]))
    width = max(map(len, rows))
    input_ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    completion_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks])
    attention_mask = (torch.arange(width) < torch.tensor([len(r) for r in rows])[:, None]).long()

    def logps(model) -> torch.Tensor:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        per_token = torch.log_softmax(logits.float(), -1).gather(2, input_ids[:, 1:, None])[..., 0]
        return (per_token * completion_mask[:, 1:]).sum(1)

    chosen_logps, rejected_logps = logps(policy).chunk(2)
    with torch.no_grad():
        ref_chosen, ref_rejected = logps(reference).chunk(2)
    chosen_lr, rejected_lr = chosen_logps - ref_chosen, rejected_logps - ref_rejected
    beta, eps, delta = settings.beta, settings.label_smoothing, chosen_lr - rejected_lr
    if settings.loss_type == "sigmoid":
        per_sequence_loss = -F.logsigmoid(beta * delta)
    elif settings.loss_type == "robust":
        clean = -(1 - eps) * F.logsigmoid(beta * delta)
        flipped = -eps * F.logsigmoid(-beta * delta)
        per_sequence_loss = (clean - flipped) / (1 - 2 * eps)
    else:
        chosen_mask, rejected_mask = completion_mask.chunk(2)
        ipo_delta = chosen_lr / chosen_mask.sum(1).clamp(min=1.0) - rejected_lr / rejected_mask.sum(
            1
        ).clamp(min=1.0)
        per_sequence_loss = (ipo_delta - 1 / (2 * beta)) ** 2
    r_chosen, r_rejected = beta * chosen_lr.detach(), beta * rejected_lr.detach()
    metrics = {
        "rewards/chosen": r_chosen.mean(),
        "rewards/rejected": r_rejected.mean(),
        "rewards/accuracies": (r_chosen > r_rejected).float().mean(),
        "rewards/margins": (r_chosen - r_rejected).mean(),
        "logps/chosen": chosen_logps.detach().mean(),
        "logps/rejected": rejected_logps.detach().mean(),
    }
    return per_sequence_loss.mean(), metrics


def batch_of(rows: list[dict]) -> dict:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def as_pairs() -> list:
    return [(p + c + p + r, [False] * len(p) + [True] * len(c) + [False] * len(p) + [True] * len(r),
             len(p + c)) for p, c, r in PAIRS]  # fmt: skip


def our_step(model, reference, settings, rows: list[dict], chunk: int):
    loss_fn = DPOLoss(settings, chunk, None, reference)
    loss_sum, metric_sums = loss_fn(model, batch_of(rows))
    loss = loss_sum / len(PAIRS)
    loss.backward()
    return loss, {k: v / len(PAIRS) for k, v in metric_sums.items()}


LAYOUTS = {  # rows of the same pairs
    "packed": lambda pairs: [pair_row(pairs, SEQ, 0)],
    "padding": lambda pairs: [pair_row([p], SEQ, 0) for p in pairs],
}


@pytest.mark.parametrize(
    "settings",
    [DPO(), DPO(beta=0.5, loss_type="robust", label_smoothing=0.2), DPO(loss_type="ipo")],
    ids=["sigmoid", "robust", "ipo"],
)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_rewards_and_gradients_equal_trl(settings, layout):
    hf_policy, hf_ref = hf_model(0), hf_model(1)
    expected_loss, expected_metrics = trl_reference(hf_policy, hf_ref, settings)
    expected_loss.backward()
    model, adapter = ours(hf_policy)
    reference, _ = ours(hf_ref)
    loss, metrics = our_step(model, reference, settings, LAYOUTS[layout](as_pairs()), chunk=5)
    assert abs(expected_metrics["rewards/margins"]) > 0.05  # the policy is not the reference
    torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=1e-5)
    assert metrics.keys() == set(METRICS)
    for name in METRICS:
        torch.testing.assert_close(metrics[name], expected_metrics[name], atol=1e-5, rtol=1e-5)
    grads = adapter.to_hf({n: p.grad for n, p in model.named_parameters()}, layout="hub")
    for name, p in hf_policy.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_packed_equals_padding_loss_and_gradients():
    """The same pairs packed into one row (document masks, restarted positions) and one pair
    per row give the same loss, metrics and gradients; and the chunk size changes nothing."""
    results = []
    for layout, chunk in (("packed", 7), ("padding", 0), ("packed", 1)):
        model, _ = ours(hf_model(0))
        reference, _ = ours(hf_model(1))
        loss, metrics = our_step(model, reference, DPO(), LAYOUTS[layout](as_pairs()), chunk)
        results.append((loss, metrics, {n: p.grad for n, p in model.named_parameters()}))
    for loss, metrics, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(metrics, results[0][1], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(grads, results[0][2], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 0])
def test_chunked_token_logps_equal_log_softmax(chunk):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 8, generator=gen, requires_grad=True)
    w = torch.randn(11, 8, generator=gen, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    labels[0, :2] = -100
    upstream = torch.randn(2, 5, generator=gen)
    got = token_logps(h, w, labels, chunk)
    (got * upstream).sum().backward()
    got_grads = (h.grad.clone(), w.grad.clone())
    h.grad, w.grad = None, None
    logp = torch.log_softmax(h @ w.T, -1).gather(2, labels.clamp(min=0)[..., None])[..., 0]
    expected = logp * (labels != -100)
    (expected * upstream).sum().backward()
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_grads, (h.grad, w.grad), atol=1e-6, rtol=1e-6)


def test_lora_adapters_off_is_the_frozen_base_model():
    """With LoRA the reference pass is the policy with its adapters switched off: exactly the
    base model (a frozen copy), while outside the context the adapters act again."""
    base, _ = ours(hf_model(0))
    model = copy.deepcopy(base)
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "down_proj"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:  # B = 0 would make the adapters a no-op anyway
                p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with adapters_off(model):
            off = model(tokens)
        on = model(tokens)
        expected = base(tokens)
    torch.testing.assert_close(off, expected, atol=0, rtol=0)
    assert (on - expected).abs().max() > 1e-2
    rows = [pair_row(as_pairs(), SEQ, 0)]
    lora_loss = DPOLoss(DPO(), 0, None, None, adapters_off)(model, batch_of(rows))
    copy_loss = DPOLoss(DPO(), 0, None, base)(model, batch_of(rows))
    torch.testing.assert_close(lora_loss, copy_loss, atol=0, rtol=0)
