"""[model] -> Qwen3ModelArgs: flavors, overrides, and MoE knobs on dense flavors."""

import pytest

from torchtitan_ablate.config import ConfigError, JobConfig, load_config
from torchtitan_ablate.models.qwen3.args import Qwen3ModelArgs
from torchtitan_ablate.models.qwen3.sizes import build_model_args


def _model_args(config: JobConfig) -> Qwen3ModelArgs:
    return build_model_args(
        config.model, config.training.seq_len, config.checkpoint.initial_load_path
    )


def test_seq_len_longer_than_the_flavor_raises_max_seq_len():
    config = load_config(["--training.seq_len", "4096"])  # debugmodel: max_seq_len 2048
    assert _model_args(config).max_seq_len == 4096


def test_unknown_flavor_and_auto_without_a_folder_are_config_errors():
    with pytest.raises(ConfigError, match="model.flavor = 'auto' needs checkpoint"):
        _model_args(load_config(["--model.flavor", "auto"]))


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model.num_experts", "8"], "model.num_experts = 8 applies to MoE flavors only"),
        (["--model.moe_aux_loss_coef", "0.01"], "model.moe_aux_loss_coef = 0.01 applies to MoE"),
        (["--model.moe_bias_update_rate", "0.01"], "model.moe_bias_update_rate = 0.01 applies"),
    ],
)
def test_moe_knobs_on_a_dense_flavor_are_errors(args, needle):
    with pytest.raises(ConfigError, match=needle):
        _model_args(load_config(["--model.flavor", "debugmodel"] + args))


def test_model_overrides():
    # "Keep" and "off" values pass on a dense flavor (shared argument lists set them).
    dense = _model_args(
        load_config(["--model.moe_aux_loss_coef", "0", "--model.moe_bias_update_rate", "0"])
    )
    assert dense.num_experts == 0
    moe = load_config(["--model.flavor", "debugmodel_moe", "--model.num_experts", "4"])
    moe.model.n_layers, moe.model.moe_aux_loss_coef = 1, 0.0
    args = _model_args(moe)
    assert (args.num_experts, args.n_layers, args.moe_aux_loss_coef) == (4, 1, 0.0)
    # 0 is not "keep the flavor's value": the loader rejects it before any build.
    with pytest.raises(ConfigError, match="model.n_layers = 0: -1"):
        load_config(["--model.flavor", "debugmodel_moe", "--model.n_layers", "0"])
