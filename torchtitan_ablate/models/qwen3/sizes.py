"""This run's Qwen3 sizes: a flavor (or an HF folder's config.json) with the config's overrides.

The one place where `[model]` becomes a `Qwen3ModelArgs`: the trainer, the estimator, bench and
the ablation dry run all reach it through `build.check_layout`.
"""

import dataclasses

from torchtitan_ablate.config import ConfigError
from torchtitan_ablate.config.job_config import Model as ModelConfig
from torchtitan_ablate.models.hf_config import read_hf_config
from torchtitan_ablate.models.qwen3.args import Qwen3ModelArgs, qwen3_flavors


def build_model_args(
    model: ModelConfig,
    seq_len: int,
    initial_load_path: str | None,
    force_load_balance: bool = False,
) -> Qwen3ModelArgs:
    """The flavor's sizes with this run's overrides applied (-1 keeps the flavor's value; the
    config loader has checked the ranges). MoE knobs on a dense flavor are an error, not ignored.
    initial_load_path: the folder whose config.json flavor "auto" reads. force_load_balance:
    debug.moe_force_load_balance (round-robin routing, benchmarks only)."""
    if model.flavor == "auto":
        base = _auto_flavor(initial_load_path)
    else:
        base = qwen3_flavors.get(model.flavor)
    if base is None:
        raise ConfigError(
            f"model.flavor = {model.flavor!r}: auto or one of {', '.join(qwen3_flavors)}"
        )
    if not base.num_experts:
        _reject_moe_knobs_on_dense(model)
        if force_load_balance:
            raise ConfigError(
                f"debug.moe_force_load_balance = true applies to MoE flavors only and "
                f"model.flavor = {model.flavor!r} is dense: remove it (or use a MoE flavor)"
            )
    overrides: dict = {"attn_backend": model.attn_backend}
    if force_load_balance:
        overrides["moe_force_load_balance"] = True
    if model.moe_aux_loss_coef >= 0:
        overrides["moe_aux_loss_coef"] = model.moe_aux_loss_coef
    if model.moe_bias_update_rate > 0:
        overrides["moe_bias_update_rate"] = model.moe_bias_update_rate
    for key in ("vocab_size", "n_layers", "num_experts"):
        if getattr(model, key) != -1:
            overrides[key] = getattr(model, key)
    overrides["max_seq_len"] = max(base.max_seq_len, seq_len)
    try:
        return dataclasses.replace(base, **overrides)
    except ValueError as e:
        raise ConfigError(f"model.flavor = {model.flavor!r} with these overrides: {e}") from None


def _reject_moe_knobs_on_dense(model: ModelConfig) -> None:
    """model.num_experts, moe_aux_loss_coef and moe_bias_update_rate on a dense flavor: the
    model has no router for them to act on. Values that mean "keep" or "off" (-1, 0) are what a
    dense model does anyway and pass (shared argument lists set moe_aux_loss_coef = 0)."""
    harmless = {"num_experts": (-1,), "moe_aux_loss_coef": (-1, 0), "moe_bias_update_rate": (0,)}
    for key, ok in harmless.items():
        value = getattr(model, key)
        if value not in ok:
            raise ConfigError(
                f"model.{key} = {value} applies to MoE flavors only (e.g. debugmodel_moe, "
                f"30B-A3B) and model.flavor = {model.flavor!r} is dense: remove it (or use a MoE "
                "flavor)"
            )


def _auto_flavor(initial_load_path: str | None) -> Qwen3ModelArgs:
    """model.flavor = "auto": the sizes of the config.json in checkpoint.initial_load_path."""
    if not initial_load_path:
        raise ConfigError(
            "model.flavor = 'auto' needs checkpoint.initial_load_path (a folder holding "
            "config.json: an HF checkpoint or a converted DCP one)"
        )
    try:
        return Qwen3ModelArgs.from_hf_config(read_hf_config(initial_load_path))
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(f"model.flavor = 'auto': {e}") from None
