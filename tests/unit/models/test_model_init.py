"""Meta-device build, to_empty, init_weights: finite, tied, deterministic, complete."""

import dataclasses

import pytest
import torch

from torchtitan_ablate.models.common.rope import rope_cos_sin
from torchtitan_ablate.models.qwen3 import Qwen3Model, qwen3_flavors

FLAVORS = ["debugmodel", "debugmodel_moe"]


def build(name: str, seed: int = 0, **overrides) -> Qwen3Model:
    args = dataclasses.replace(qwen3_flavors[name], n_layers=2, **overrides)
    with torch.device("meta"):
        model = Qwen3Model(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


@pytest.mark.parametrize("name", FLAVORS)
def test_meta_build_init_gives_finite_outputs_and_tied_weights(name: str) -> None:
    model = build(name)
    assert model.output.weight is model.tok_embeddings.weight
    for key, t in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items():
        assert torch.isfinite(t).all(), key
    cos_SK, _ = rope_cos_sin(model.args.head_dim, model.args.max_seq_len, model.args.rope_theta)
    torch.testing.assert_close(model.rope_cos, cos_SK, atol=0, rtol=0)
    logits_BSV = model(torch.randint(0, 2048, (2, 16)))
    assert torch.isfinite(logits_BSV).all() and logits_BSV.std() > 0


@pytest.mark.parametrize("name", FLAVORS)
def test_init_is_deterministic_and_seed_dependent(name: str) -> None:
    a, b, c = build(name, 0), build(name, 0), build(name, 1)
    for key, t in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[key], t, atol=0, rtol=0)
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)


def test_init_std_follows_the_recipe() -> None:
    model = build("debugmodel", tie_embeddings=False)
    assert abs(model.tok_embeddings.weight.std().item() - 1.0) < 2e-2  # untied: N(0, 1)
    assert abs(model.output.weight.std().item() - 256**-0.5 * 0.986) < 5e-3  # 3-sigma truncation
    wo_1 = model.layers["1"].attention.wo.weight  # depth-scaled: 0.02 / sqrt(2 * 2)
    assert abs(wo_1.std().item() - 0.01 * 0.986) < 1e-3
    assert torch.equal(model.norm.weight, torch.ones(256))


def test_moe_hooks() -> None:
    model = build("debugmodel_moe", moe_bias_update_rate=1e-3)
    assert model.moe_aux_loss() is None  # no forward yet
    model(torch.randint(0, 2048, (2, 16)))
    aux = model.moe_aux_loss()
    assert not aux.requires_grad and aux.item() > 0  # logged; its gradient rides on outputs
    load = model.expert_load()
    assert load.shape == (2, 8) and load.sum().item() == 2 * 2 * 16 * 2
    model.update_expert_bias(load)
    bias = model.layers["0"].moe.expert_bias
    assert bias.abs().sum() > 0 and "layers.0.moe.expert_bias" in model.state_dict()
    model.reset_expert_load()
    assert model.expert_load().sum() == 0
    dense = build("debugmodel")
    assert dense.moe_aux_loss() is None and dense.expert_load() is None
