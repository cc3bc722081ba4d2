"""Qwen3ModelArgs: flavors, HF config conversion, parameter and FLOP counts."""

import dataclasses

import pytest
import torch
from transformers import Qwen3Config, Qwen3MoeConfig

from torchtitan_ablate.models.qwen3 import Qwen3Model, Qwen3ModelArgs, qwen3_flavors

# Abbreviated hub config.json files (the keys the conversion reads, as the hub spells them).
HUB_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_experts": 128, "num_experts_per_tok": 8, "router_aux_loss_coef": 0.001,
}  # fmt: skip
HUB_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "tie_word_embeddings": True,
}  # fmt: skip


def test_hub_configs_give_the_flavors() -> None:
    assert Qwen3ModelArgs.from_hf_config(HUB_30B_A3B) == qwen3_flavors["30B-A3B"]
    assert Qwen3ModelArgs.from_hf_config(HUB_0_6B) == qwen3_flavors["0.6B"]


@pytest.mark.parametrize("name", sorted(qwen3_flavors))
def test_to_hf_config_round_trip(name: str) -> None:
    args = qwen3_flavors[name]
    assert Qwen3ModelArgs.from_hf_config(args.to_hf_config()) == args


@pytest.mark.parametrize("name", ["debugmodel", "debugmodel_moe"])
def test_transformers_reads_our_config(name: str) -> None:
    args = qwen3_flavors[name]
    config_cls = Qwen3MoeConfig if args.num_experts else Qwen3Config
    hf_dict = args.to_hf_config()
    config = config_cls(**{k: v for k, v in hf_dict.items() if k != "architectures"})
    # to_dict() says num_local_experts and nests rope_theta under rope_parameters.
    assert Qwen3ModelArgs.from_hf_config(config.to_dict()) == args


def test_flavor_sizes() -> None:
    assert set(qwen3_flavors) == {
        "debugmodel", "debugmodel_moe", "0.6B", "1.7B", "4B", "8B", "14B", "32B", "30B-A3B",
        "235B-A22B",
    }  # fmt: skip
    moe = qwen3_flavors["30B-A3B"]
    assert 30.0e9 < moe.num_params() < 31.0e9
    assert 3.0e9 < moe.num_params(active=True) < 3.5e9
    big = qwen3_flavors["235B-A22B"]
    assert 234e9 < big.num_params() < 236e9 and 21e9 < big.num_params(active=True) < 23e9
    assert 0.59e9 < qwen3_flavors["0.6B"].num_params() < 0.61e9
    assert 8.1e9 < qwen3_flavors["8B"].num_params() < 8.3e9


@pytest.mark.parametrize(
    "args",
    [
        qwen3_flavors["debugmodel"],
        qwen3_flavors["debugmodel_moe"],
        dataclasses.replace(
            qwen3_flavors["debugmodel_moe"], tie_embeddings=False, mlp_only_layers=[0, 2]
        ),
    ],
)
def test_num_params_matches_the_model(args: Qwen3ModelArgs) -> None:
    with torch.device("meta"):
        model = Qwen3Model(args)
    assert args.num_params() == sum(p.numel() for p in model.parameters())
    embed = args.vocab_size * args.dim
    assert args.num_params(embedding=False) == args.num_params() - embed


def test_flops_per_token() -> None:
    args = qwen3_flavors["debugmodel_moe"]  # tied: the output matmul still counts
    n_active = args.num_params(active=True)  # includes the (shared) table once
    attn = 12 * args.n_layers * args.n_heads * args.head_dim * 256
    assert args.num_flops_per_token(256) == 6 * n_active + attn


def test_bad_args_raise() -> None:
    with pytest.raises(ValueError, match="attn_backend"):
        dataclasses.replace(qwen3_flavors["debugmodel"], attn_backend="nope")
    with pytest.raises(ValueError, match="rope_type"):
        Qwen3ModelArgs.from_hf_config({**HUB_0_6B, "rope_scaling": {"rope_type": "yarn"}})
