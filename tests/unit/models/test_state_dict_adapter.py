"""Qwen3StateDictAdapter on native state dicts (HF-side checks live in test_hf_parity.py)."""

import dataclasses

import pytest
import torch

from torchtitan_ablate.models.qwen3 import Qwen3Model, Qwen3StateDictAdapter, qwen3_flavors


def model_and_adapter(**overrides) -> tuple[Qwen3Model, Qwen3StateDictAdapter]:
    args = dataclasses.replace(qwen3_flavors["debugmodel_moe"], n_layers=2, **overrides)
    torch.manual_seed(0)
    model = Qwen3Model(args)
    model.init_weights()
    return model, Qwen3StateDictAdapter(args)


@pytest.mark.parametrize("layout", ["hub", "fused"])
@pytest.mark.parametrize("tie", [True, False])
def test_native_round_trip(layout: str, tie: bool) -> None:
    model, adapter = model_and_adapter(tie_embeddings=tie, mlp_only_layers=[1])
    native = model.state_dict()
    hf = adapter.to_hf(native, layout=layout)
    assert ("lm_head.weight" in hf) != tie
    assert ("model.layers.0.mlp.experts.0.gate_proj.weight" in hf) == (layout == "hub")
    assert "model.layers.1.mlp.gate_proj.weight" in hf  # the dense layer
    back = adapter.from_hf(hf)
    assert back.keys() == native.keys()
    for key, t in native.items():
        torch.testing.assert_close(back[key], t, atol=0, rtol=0)
    model.load_state_dict(back, strict=True)


def test_expert_bias_is_dropped_and_restored_as_zeros() -> None:
    model, adapter = model_and_adapter(moe_bias_update_rate=1e-3)
    native = model.state_dict()
    hf = adapter.to_hf(native)
    assert not any("bias" in key for key in hf)
    assert torch.equal(adapter.from_hf(hf)["layers.0.moe.expert_bias"], torch.zeros(8))


def test_untied_without_lm_head_is_an_error() -> None:
    model, adapter = model_and_adapter(tie_embeddings=False)
    hf = adapter.to_hf(model.state_dict())
    hf.pop("lm_head.weight")
    with pytest.raises(ValueError, match="missing keys: \\['lm_head.weight'\\]"):
        adapter.from_hf(hf)


def test_wrong_layout_name() -> None:
    model, adapter = model_and_adapter()
    with pytest.raises(ValueError, match="layout"):
        adapter.to_hf(model.state_dict(), layout="megatron")
