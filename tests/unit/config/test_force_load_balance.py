"""debug.moe_force_load_balance: the settings it refuses (one line naming the key), the model
args it reaches, and the console mark of such runs."""

import pytest
import torch

from tests.helpers.distributed import captured_log
from torchtitan_ablate.build import check_layout
from torchtitan_ablate.components.observability.metrics import MetricsLogger
from torchtitan_ablate.config import ConfigError, load_config

FORCED = ["--model.flavor", "debugmodel_moe", "--debug.moe_force_load_balance", "true"]
NO_AUX = ["--model.moe_aux_loss_coef", "0"]


@pytest.mark.parametrize(
    "args, needle",
    [
        ([], "model.moe_aux_loss_coef = -1.0 .-1 keeps the flavor's 0.001.: set it to 0"),
        (["--model.moe_aux_loss_coef", "0.01"], "model.moe_aux_loss_coef = 0.01"),
        (NO_AUX + ["--model.moe_bias_update_rate", "1e-3"], "set model.moe_bias_update_rate = 0"),
        (NO_AUX + ["--checkpoint.enable", "true"], "set checkpoint.enable = false"),
        (NO_AUX + ["--memory_estimation.ep_imbalance", "1.5"], "ep_imbalance = 1.5: set it to 1"),
    ],
)
def test_settings_it_makes_meaningless_are_refused(args: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as err:
        load_config(FORCED + args)
    assert "debug.moe_force_load_balance = true" in str(err.value)
    assert "\n" not in str(err.value)


def test_it_reaches_the_model_args_of_moe_flavors_only() -> None:
    layout = check_layout(load_config(FORCED + NO_AUX), world_size=1)
    assert layout.model_args.moe_force_load_balance
    assert not check_layout(load_config(NO_AUX), 1).model_args.moe_force_load_balance
    dense = load_config(["--debug.moe_force_load_balance", "true"] + NO_AUX)
    with pytest.raises(ConfigError, match="applies to MoE flavors only"):
        check_layout(dense, world_size=1)


def test_console_line_marks_forced_balance(tmp_path) -> None:
    metrics = MetricsLogger(load_config([]).metrics, str(tmp_path), torch.device("cpu"), 1.0, True)
    metrics.open(resumed_step=0)
    values = {"loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "moe_aux_loss": 0.0}
    values["expert_load_imbalance"] = 1.0
    with captured_log() as lines:
        metrics.log(1, values)
        metrics.log(2, {**values, "moe_force_load_balance": True})
    metrics.close()
    assert "forced" not in lines[0]
    assert "expert_load max/mean 1.00 (forced round-robin)" in lines[1]
