"""Logits equal HF transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM on loaded weights."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from torchtitan_ablate.models.qwen3 import Qwen3Model, Qwen3ModelArgs, Qwen3StateDictAdapter

N_HEADS = 4


def hf_model(kind: str, n_kv_heads: int) -> torch.nn.Module:
    common = dict(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=N_HEADS,
        num_key_value_heads=n_kv_heads,
        head_dim=16,
        intermediate_size=80,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=kind == "dense_tied",
        attn_implementation="eager",
    )
    if kind.startswith("dense"):
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        config = Qwen3MoeConfig(
            **common,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=kind == "moe",  # the mixed variant checks the unnormalised weights
            mlp_only_layers=[1] if kind == "moe_mixed" else [],
        )
        model = Qwen3MoeForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():  # HF's 0.02 init makes all logits ~0; use weights that matter
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model.eval()


def ours_from_hf(hf: torch.nn.Module, **overrides) -> tuple[Qwen3Model, Qwen3StateDictAdapter]:
    args = Qwen3ModelArgs.from_hf_config(hf.config.to_dict(), **overrides)
    adapter = Qwen3StateDictAdapter(args)
    model = Qwen3Model(args)
    model.load_state_dict(adapter.from_hf(hf.state_dict()), strict=True)
    return model.eval(), adapter


KINDS = ["dense_tied", "dense_untied", "moe", "moe_mixed"]


@pytest.mark.parametrize("gqa_ratio", [1, 2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_hf(kind: str, gqa_ratio: int) -> None:
    hf = hf_model(kind, N_HEADS // gqa_ratio)
    ours, _ = ours_from_hf(hf)
    tokens_BS = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected_BSV = hf(tokens_BS).logits
        got_BSV = ours(tokens_BS)
    assert expected_BSV.abs().max() > 1.0  # the comparison is not between near-zero logits
    torch.testing.assert_close(got_BSV, expected_BSV, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip(kind: str) -> None:
    hf = hf_model(kind, 2)
    _, adapter = ours_from_hf(hf)
    hf_sd = hf.state_dict()
    if adapter.args.tie_embeddings:
        hf_sd.pop("lm_head.weight")
        assert adapter.from_hf(hf_sd).keys() == adapter.from_hf(hf.state_dict()).keys()
    layout = "fused" if kind.startswith("moe") else "hub"
    back = adapter.to_hf(adapter.from_hf(hf_sd), layout=layout)
    assert back.keys() == hf_sd.keys()
    for key, tensor in hf_sd.items():
        torch.testing.assert_close(back[key], tensor, atol=0, rtol=0)


def test_hub_expert_layout_loads() -> None:
    hf = hf_model("moe", 2)
    ours, adapter = ours_from_hf(hf)
    # Build the hub (per-expert) layout by hand from transformers' fused one: gate rows first.
    hub_sd, inter = {}, adapter.args.moe_hidden_dim
    for key, t in hf.state_dict().items():
        if key.endswith("mlp.experts.gate_up_proj"):
            base = key.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                hub_sd[f"{base}{e}.gate_proj.weight"] = t[e, :inter]
                hub_sd[f"{base}{e}.up_proj.weight"] = t[e, inter:]
        elif key.endswith("mlp.experts.down_proj"):
            base = key.removesuffix("down_proj")
            for e in range(t.shape[0]):
                hub_sd[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            hub_sd[key] = t
    native = adapter.from_hf(hub_sd)
    for key, t in ours.state_dict().items():
        torch.testing.assert_close(native[key], t, atol=0, rtol=0)
    written = adapter.to_hf(native)  # hub layout is the default
    assert written.keys() == hub_sd.keys()
    for key, t in hub_sd.items():
        torch.testing.assert_close(written[key], t, atol=0, rtol=0)


def test_bad_state_dicts_name_the_keys() -> None:
    hf = hf_model("moe", 2)
    _, adapter = ours_from_hf(hf)
    hf_sd = dict(hf.state_dict())
    hf_sd.pop("model.layers.0.self_attn.q_proj.weight")
    hf_sd["model.layers.0.extra.weight"] = torch.zeros(1)
    hf_sd["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError) as err:
        adapter.from_hf(hf_sd)
    for text in ("q_proj", "extra.weight", "model.norm.weight: got (3,)"):
        assert text in str(err.value)
    with pytest.raises(ValueError, match="missing keys"):
        adapter.to_hf({"tok_embeddings.weight": torch.zeros(96, 64)})
