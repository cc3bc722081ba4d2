"""apply_float8: float8 training (torchao) for Linear layers and, optionally, routed experts.

It runs first in parallelize_qwen3 because it swaps module types (nn.Linear -> Float8Linear) and
parameter types (expert weights -> a wrapper tensor): expert parallel, AC, compile and FSDP must
all see the final modules. It works on the meta device, before to_empty/init_weights.

- Linear layers: torchao.float8's Float8Linear with the "tensorwise", "rowwise" or
  "rowwise_with_gw_hp" (weight gradient in bf16) recipe. Names containing one of
  `float8.filter_fqns` (default: output, router) stay high precision, and so do linears with a
  dimension that is not a multiple of 16 (float8 GEMMs need 16-aligned operands).
- Routed experts (`float8.moe`): torchao.prototype.moe_training swaps GroupedExperts' w1/w2/w3
  for a wrapper tensor whose torch._grouped_mm runs rowwise float8 grouped GEMMs. Its kernels are
  Triton + torch._scaled_grouped_mm, so this needs CUDA (SM 9.0+) and the rowwise recipe.
- CPU: Linear conversion and forward/backward run (torch._scaled_mm has a CPU kernel), so tests
  and the memory estimator take the same path as training.

The trainer calls `float8_post_optimizer_step(model)` after every optimizer step.
"""

import dataclasses
import logging
import re
import sys
from typing import TYPE_CHECKING

import torch
from torch import nn

from torchtitan_ablate.config import ConfigError
from torchtitan_ablate.config.job_config import Float8
from torchtitan_ablate.models.common.experts import GroupedExperts

if TYPE_CHECKING:  # torchao is optional: imported at run time only once float8 is enabled
    from torchao.float8 import Float8LinearConfig

logger = logging.getLogger("torchtitan_ablate")

# torchao is ABI-stable from 0.17 and 0.18 supports torch >= 2.11, so one version serves the
# GPU box (torch 2.11) and the CPU machines (torch 2.13); 0.17 has the same API.
TORCHAO_VERSION = "0.18.0"
ALIGN = 16  # float8 GEMMs need every operand dimension to be a multiple of 16
MIN_CAPABILITY = (8, 9)  # Ada / Hopper: the first GPUs with float8 tensor cores
MIN_CAPABILITY_MOE = (9, 0)  # torch._scaled_grouped_mm is built for Hopper and newer


def apply_float8(model: nn.Module, config: Float8, device_type: str, fsdp_enabled: bool) -> None:
    """Convert `model` in place for float8 training; the caller checks `config.enable`.

    `config` comes from load_config, which checked the recipe rules (config/rules.py); the
    device rules are checked here, where the device is known.
    fsdp_enabled: whether FSDP2 will shard the model; float8 all-gather only matters then.
    """
    # torchao asserts the all-gather rule itself; experts would silently mix scalings.
    assert not config.moe or config.recipe == "rowwise", "float8.moe takes the rowwise recipe"
    _check_device(device_type, config.moe)
    _import_torchao(device_type)
    from torchao.float8 import convert_to_float8_training

    converted: list[str] = []
    skipped: list[str] = []

    def keep_fn(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        ok = not any(f in fqn for f in config.filter_fqns) and _aligned(module.weight.shape)
        (converted if ok else skipped).append(fqn)
        return ok

    linear_config = _linear_config(config, fsdp_enabled)
    convert_to_float8_training(model, module_filter_fn=keep_fn, config=linear_config)
    n_experts = _convert_experts(model, skipped) if config.moe else 0

    gather = ", float8 all-gather" if linear_config.enable_fsdp_float8_all_gather else ""
    moe = f", {n_experts} routed-expert modules (rowwise grouped GEMM)" if config.moe else ""
    logger.info(
        f"float8: {len(converted)} Linear modules ({config.recipe}{gather}){moe}; "
        f"kept high precision: {', '.join(_collapse(skipped)) or 'none'}"
    )


def float8_post_optimizer_step(model: nn.Module) -> None:
    """Call after every optimizer.step(). With tensorwise float8 FSDP all-gather, it computes
    the next float8 scales of all sharded weights in one all-reduce (torchao's
    precompute_float8_dynamic_scale_for_fsdp); without it, each weight would all-reduce its own
    amax inside the forward. A no-op (a scan of the modules) in every other setup.
    """
    if "torchao.float8" not in sys.modules:  # nothing can have been converted
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.float8_linear import Float8Linear

    if any(
        isinstance(m, Float8Linear) and m.config.enable_fsdp_float8_all_gather
        for m in model.modules()
    ):
        precompute_float8_dynamic_scale_for_fsdp(model)


def _import_torchao(device_type: str) -> None:
    # On CPU torchao logs a warning per CUDA kernel library it cannot load; they are not used.
    torchao_logger = logging.getLogger("torchao")
    level = torchao_logger.level
    if device_type != "cuda":
        torchao_logger.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"float8.enable = true needs torchao, which is not installed: pip install "
            f"torchao=={TORCHAO_VERSION} (or the project's float8 extra), or set float8.enable "
            "= false"
        ) from None
    finally:
        torchao_logger.setLevel(level)


def _check_device(device_type: str, moe: bool) -> None:
    if device_type == "cpu":
        if moe:
            raise ConfigError(
                "float8.moe = true needs CUDA: torchao's float8 grouped GEMM has no CPU kernel"
            )
        return
    if device_type != "cuda":
        raise ConfigError(
            f"float8.enable = true runs on cuda or cpu, not {device_type!r} (training.device)"
        )
    capability = torch.cuda.get_device_capability()
    need = MIN_CAPABILITY_MOE if moe else MIN_CAPABILITY
    if capability < need:
        what = "float8.moe" if moe else "float8.enable"
        raise ConfigError(
            f"{what} = true needs a GPU of SM {need[0]}.{need[1]} or newer; "
            f"{torch.cuda.get_device_name()} is SM {capability[0]}.{capability[1]}"
        )


def _linear_config(config: Float8, fsdp_enabled: bool) -> "Float8LinearConfig":
    from torchao.float8 import Float8LinearConfig

    linear_config = Float8LinearConfig.from_recipe_name(config.recipe)
    if config.enable_fsdp_float8_all_gather:
        if not fsdp_enabled:
            logger.warning("float8.enable_fsdp_float8_all_gather has no effect without FSDP")
        else:
            linear_config = dataclasses.replace(linear_config, enable_fsdp_float8_all_gather=True)
    return linear_config


def _convert_experts(model: nn.Module, skipped: list[str]) -> int:
    """Wrap the 3-D weights of every 16-aligned GroupedExperts; returns how many were wrapped."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    wanted: list[str] = []
    for fqn, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            aligned = all(_aligned(p.shape[1:]) for p in (module.w1, module.w2, module.w3))
            (wanted if aligned else skipped).append(fqn)
    if not wanted:
        logger.warning("float8.moe = true has no effect: no 16-aligned routed experts")
        return 0

    def keep_fn(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, GroupedExperts) and fqn in wanted

    # Groups are already padded to 16 rows by the experts (GROUP_ALIGN_ROWS), so torchao must
    # not pad again.
    op_config = Float8TrainingOpConfig(pad_token_groups_for_grouped_mm=False)
    quantize_(model, op_config, filter_fn=keep_fn)
    return len(wanted)


def _aligned(shape: torch.Size) -> bool:
    return all(d % ALIGN == 0 for d in shape)


def _collapse(fqns: list[str]) -> list[str]:
    """'layers.0.moe.router.gate', 'layers.1.moe.router.gate' -> 'layers.*.moe.router.gate'."""
    return list(dict.fromkeys(re.sub(r"(^|\.)\d+(\.|$)", r"\1*\2", f) for f in fqns))
