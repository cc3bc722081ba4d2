"""The model families the engine builds, by model.name (each family's ModelSpec: models/spec.py).

A second family is its folder models/<name>/ (args, model, parallelize, state-dict adapter and
a spec.py naming them) plus its spec in SPECS below. Everything else finds the family here: by
model.name (`get_spec`), by a model's args (`spec_for_args`, for the tools that hold sizes) or
by an HF config.json's model_type (`hf_model_args`).
"""

import os
from typing import Any

from torchtitan_ablate.config.errors import ConfigError
from torchtitan_ablate.models.hf_config import read_hf_config
from torchtitan_ablate.models.qwen3.spec import QWEN3_SPEC
from torchtitan_ablate.models.spec import ModelSpec, StateDictAdapter

SPECS: dict[str, ModelSpec] = {spec.name: spec for spec in (QWEN3_SPEC,)}


def register(spec: ModelSpec) -> None:
    """Adds a family at run time (a test's own family); the built-in ones are in SPECS."""
    if spec.name in SPECS:
        raise ValueError(f"model family {spec.name!r} is registered already")
    SPECS[spec.name] = spec


def unregister(name: str) -> None:
    del SPECS[name]


def get_spec(name: str) -> ModelSpec:
    spec = SPECS.get(name)
    if spec is None:
        raise ConfigError(
            f"model.name = {name!r} is no registered model family: one of {', '.join(SPECS)}"
        )
    return spec


def spec_for_args(args: Any) -> ModelSpec:
    """The family whose sizes `args` are (each family has its own args class)."""
    spec = next((s for s in SPECS.values() if type(args) is s.args_cls), None)
    assert spec is not None, f"{type(args).__name__} is no registered family's args class"
    return spec


def state_dict_adapter(args: Any) -> StateDictAdapter:
    """The HF conversion of the model of these sizes; ValueError for a family without one."""
    spec = spec_for_args(args)
    if spec.state_dict_adapter is None:
        raise ValueError(
            f"model family {spec.name!r} has no state-dict adapter: it cannot read or write "
            "HF checkpoints or convert DCP ones"
        )
    return spec.state_dict_adapter(args)


def hf_model_args(path: str | os.PathLike, **overrides: Any) -> Any:
    """Model sizes from an HF folder's config.json, in the family its model_type names."""
    config = read_hf_config(path)
    return args_from_hf_config(config, f"{path}/config.json", **overrides)


def args_from_hf_config(config: dict[str, Any], where: str, **overrides: Any) -> Any:
    """Model sizes from an HF config dict (`where` names it in errors)."""
    model_type = config.get("model_type")
    spec = next((s for s in SPECS.values() if model_type in s.hf_model_types), None)
    if spec is None:
        known = [t for s in SPECS.values() for t in s.hf_model_types]
        raise ValueError(
            f"{where} has model_type {model_type!r}, which no registered model family reads "
            f"(they read {', '.join(known)})"
        )
    return spec.args_cls.from_hf_config(config, **overrides)
