"""LoRA: parameter count, frozen base, zero-init B, merge, grouped-GEMM path, meta + fake mode."""

import copy
import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from torchtitan_ablate.config.job_config import LORA_TARGETS
from torchtitan_ablate.models.common.lora import (
    apply_lora,
    init_lora_weights,
    lora_parameter_count,
    merge_lora_state_dict,
)
from torchtitan_ablate.models.qwen3 import Qwen3Model, Qwen3ModelArgs

DENSE = Qwen3ModelArgs(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=48,
    max_seq_len=32,
)  # fmt: skip
MOE = dataclasses.replace(DENSE, num_experts=4, top_k=2, moe_hidden_dim=16)
ALL_DENSE = [t for t in LORA_TARGETS if t != "experts"]
ALL_MOE = ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]


def built(args: Qwen3ModelArgs, seed: int = 0) -> Qwen3Model:
    torch.manual_seed(seed)
    model = Qwen3Model(args)
    model.init_weights()
    return model


def tokens(args: Qwen3ModelArgs) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))


def expected_count(args: Qwen3ModelArgs, rank: int, targets: list[str]) -> int:
    q, kv, d = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.dim
    shapes = {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q)}
    h, e, i = args.hidden_dim, args.num_experts, args.moe_hidden_dim
    shapes |= {"gate_proj": (h, d), "up_proj": (h, d), "down_proj": (d, h)}
    linear = [shapes[t] for t in targets if t != "experts"]
    experts = [(e, i, d), (e, i, d), (e, d, i)] if "experts" in targets else []
    return args.n_layers * lora_parameter_count(linear, rank, experts)


@pytest.mark.parametrize("args,targets", [(DENSE, ALL_DENSE), (MOE, ALL_MOE), (DENSE, ["v_proj"])])
def test_trainable_count_is_the_lora_formula_and_base_is_frozen(args, targets):
    model = built(args)
    n_lora = apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=targets)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all(".lora_" in n for n in trainable)
    assert n_lora == sum(p.numel() for p in trainable.values()) == expected_count(args, 4, targets)


@pytest.mark.parametrize("args,targets", [(DENSE, ALL_DENSE), (MOE, ALL_MOE)])
def test_zero_init_b_then_merge_gives_the_adapted_logits(args, targets):
    base = built(args)
    model = copy.deepcopy(base)
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=targets)
    init_lora_weights(model)
    with torch.no_grad():  # B = 0: exactly the base model
        torch.testing.assert_close(model(tokens(args)), base(tokens(args)), rtol=0, atol=0)
        for name, p in model.named_parameters():
            if ".lora_b" in name:
                p.normal_(0, 0.2)
        adapted = model(tokens(args))
        assert (adapted - base(tokens(args))).abs().max() > 1e-3
    merged = merge_lora_state_dict(model.state_dict(), alpha=8.0)
    assert not any(".lora_" in k for k in merged)
    fresh = Qwen3Model(args)
    fresh.load_state_dict(merged, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens(args)), adapted, rtol=1e-5, atol=5e-5)


def test_expert_grouped_mm_path_equals_the_loop():
    model = built(MOE)
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=["experts"])
    init_lora_weights(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_b" in name:
                p.normal_(0, 0.2)
    outs = []
    for grouped in (False, True):
        for moe in model.moe_layers():
            moe.experts.force_grouped_mm = grouped
        logits = model(tokens(MOE))
        logits.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        outs.append((logits.detach(), grads))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    assert outs[0][1].keys() == outs[1][1].keys() and all(".lora_" in k for k in outs[0][1])
    for k in outs[0][1]:
        torch.testing.assert_close(outs[1][1][k], outs[0][1][k], rtol=1e-4, atol=1e-5)


def test_lora_init_is_seeded_by_name_not_by_call_order():
    a, b = built(DENSE), built(DENSE)
    for m in (a, b):
        apply_lora(m, rank=2, alpha=4.0, dropout=0.0, target_modules=ALL_DENSE)
    torch.manual_seed(0)
    init_lora_weights(a)
    torch.manual_seed(0)
    torch.rand(5)  # other random draws in between do not change the adapters
    init_lora_weights(b)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if ".lora_" in name:
            assert torch.equal(pa, pb), name


@pytest.mark.parametrize("args,targets", [(DENSE, ALL_DENSE), (MOE, ALL_MOE)])
def test_meta_build_and_fake_mode_step(args, targets):
    """What the memory estimator does: meta build + LoRA, materialised as fake tensors, a train
    step; and LoRA applied to a model built under fake mode."""
    with torch.device("meta"):
        model = Qwen3Model(args).to(torch.bfloat16)  # bf16: the grouped GEMM's dtype
    apply_lora(model, rank=4, alpha=8.0, dropout=0.1, target_modules=targets)
    assert all(p.is_meta for p in model.parameters())
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")  # values do not matter: no init_weights, no host syncs
        for moe in model.moe_layers():
            moe.experts.force_grouped_mm = True
        init_lora_weights(model)
        model(torch.randint(0, args.vocab_size, (2, 8))).sum().backward()
        got_grad = {n for n, p in model.named_parameters() if p.grad is not None}
        fake_built = Qwen3Model(args)
        n_lora = apply_lora(fake_built, rank=4, alpha=8.0, dropout=0.1, target_modules=targets)
        init_lora_weights(fake_built)
    assert got_grad == {n for n, _ in model.named_parameters() if ".lora_" in n}
    assert n_lora == expected_count(args, 4, targets)
