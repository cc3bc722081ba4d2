"""Hugging Face export of a DCP checkpoint: config.json + model.safetensors (sharded with an
index above max_shard_gib), LoRA adapters merged, the tokenizer files of the run's HF starting
point copied when known. What scripts/convert_checkpoint.py --to hf runs, and what the trainer
writes after its last step with checkpoint.last_save_in_hf (save_last_in_hf).

The model sizes come from a flavor or HF config given, else from what the checkpoint records of
the run that made it, else from the run's config.toml next to it, else from a config.json inside
the DCP folder. The whole model is read into this process's CPU memory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomllib
import torch

from torchtitan_ablate.components.checkpoint.export_folder import remove_stale, temp_folder
from torchtitan_ablate.components.checkpoint.hf import save_hf_checkpoint
from torchtitan_ablate.components.checkpoint.offline_weights import (
    find_run_toml,
    read_dcp_model,
    recorded_args,
    recorded_settings,
)
from torchtitan_ablate.components.checkpoint.peft_export import save_peft_adapters
from torchtitan_ablate.config.job_config import Model
from torchtitan_ablate.models.common.lora import merge_lora_state_dict
from torchtitan_ablate.models.registry import (
    args_from_hf_config,
    get_spec,
    hf_model_args,
    state_dict_adapter,
)

logger = logging.getLogger("torchtitan_ablate")

LAST_SAVE_HF = "hf"  # checkpoint.last_save_in_hf writes <folder>/step-<N>/hf


def what_made(dcp_dir: Path, flavor: str | None) -> tuple[dict[str, Any], Any, bool]:
    """(the settings of the run that wrote dcp_dir as "section.key" -> value, the model sizes,
    whether the checkpoint recorded them): its record, else its run's config.toml, said on
    stderr (the latest launch wrote it, maybe not this checkpoint's), else nothing."""
    record = recorded_settings(dcp_dir)
    if record is not None:
        args = recorded_args(record) if flavor is None else resolve_args(flavor, record, dcp_dir)
        return record, args, True
    toml, run = find_run_toml(dcp_dir), {}
    if toml is not None:
        print(
            f"convert_checkpoint: warning: {dcp_dir} records no model settings (a model-only "
            f"checkpoint, or an older version saved it): read from {toml}, which the run's "
            "latest launch wrote",
            file=sys.stderr,
        )
        for section, body in tomllib.loads(toml.read_text()).items():
            run.update({f"{section}.{k}": v for k, v in body.items()})
    return run, resolve_args(flavor, run, dcp_dir), False


def hf_folder_args(path: Path) -> Any:
    """hf_model_args for a folder or a config.json file; ValueError for a config of no
    registered model family."""
    try:
        if path.is_file():
            return args_from_hf_config(json.loads(path.read_text()), str(path))
        return hf_model_args(path)
    except KeyError as e:
        raise ValueError(f"{path}: the HF config lacks {e}; is it the model it names?") from None


def resolve_args(flavor: str | None, run: dict[str, Any], dcp_dir: Path) -> Any:
    """The model sizes (in the family's args class): a flavor of the run's model.name (default
    the config's), an HF folder or config.json, or the DCP folder's config.json; with the run's
    model.vocab_size, n_layers and num_experts overrides ("section.key" in `run`)."""
    name = flavor or run.get("model.flavor")
    flavors = get_spec(run.get("model.name", Model.name)).flavors
    if name in flavors:
        args = flavors[name]
    elif name and name != "auto":
        if not Path(name).exists():
            where = "--flavor" if flavor else "model.flavor of the run's config.toml:"
            raise ValueError(
                f"{where} {name!r} is neither a flavor name ({', '.join(flavors)}) nor an "
                "existing HF folder / config.json"
            )
        args = hf_folder_args(Path(name))
    elif name == "auto" and run.get("checkpoint.initial_load_path"):
        args = hf_folder_args(Path(run["checkpoint.initial_load_path"]))
    elif (dcp_dir / "config.json").is_file():
        args = hf_folder_args(dcp_dir)
    else:
        raise ValueError(
            f"cannot tell the model sizes of {dcp_dir}: pass --flavor (a flavor name or an HF "
            "folder / config.json), or keep the run's config.toml next to the checkpoint"
        )
    overrides = {k: run.get(f"model.{k}", -1) for k in ("vocab_size", "n_layers", "num_experts")}
    return dataclasses.replace(args, **{k: v for k, v in overrides.items() if v != -1})


def to_hf(dcp_dir: Path, out_dir: Path, flavor: str | None, dtype: str | None,
          max_shard_gib: float, lora_alpha: float | None,
          peft_dir: Path | None = None) -> list[str]:  # fmt: skip
    run, args, recorded = what_made(dcp_dir, flavor)
    state = read_dcp_model(dcp_dir, args)
    has_adapters = any(".lora_" in k for k in state)
    alpha = run.get("lora.alpha")
    if recorded and None not in (alpha, lora_alpha) and alpha != lora_alpha:
        raise ValueError(
            f"--lora_alpha {lora_alpha:g}: {dcp_dir} was trained with lora.alpha = {alpha:g}, "
            "which its export uses; drop --lora_alpha"
        )
    alpha = lora_alpha if lora_alpha is not None else alpha
    if alpha is None and has_adapters:
        raise ValueError(
            "the checkpoint holds LoRA adapters and records no lora.alpha: pass --lora_alpha"
        )
    initial = run.get("checkpoint.initial_load_path")
    if peft_dir is not None:  # before the merge, which drops the adapters

        def save_peft(tmp: Path) -> list[str]:
            return save_peft_adapters(
                state, tmp, state_dict_adapter(args), alpha=float(alpha or 0),
                dropout=float(run.get("lora.dropout", 0.0)),
                base_model=initial or None, is_moe=args.num_experts > 0,
                dtype=getattr(torch, dtype) if dtype else None,
            )  # fmt: skip

        write_folder(peft_dir, save_peft)
    try:
        if has_adapters:
            state = merge_lora_state_dict(state, float(alpha))
        source = initial if run.get("checkpoint.initial_load_format") == "hf" else None
        if source and not (Path(source) / "config.json").is_file():
            source = None
        if source is None and (dcp_dir / "config.json").is_file():
            source = dcp_dir
        return save_hf_checkpoint(
            state,
            args,
            out_dir,
            dtype=getattr(torch, dtype) if dtype else None,
            max_shard_bytes=int(max_shard_gib * 2**30),
            source_dir=source,
        )
    except BaseException:
        if peft_dir is not None:  # both outputs or neither
            shutil.rmtree(peft_dir, ignore_errors=True)
        raise


def check_new_folder(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder: give a new output folder")


def write_folder(out: Path, write: Callable[[Path], list[str]]) -> list[str]:
    """Runs write(tmp) on a fresh folder beside out, then renames it to out: a failed
    conversion leaves no partial (or empty) output behind, a killed one a folder that the next
    conversion there removes (components/checkpoint/export_folder.py)."""
    check_new_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out.parent)
    # Not tempfile.mkdtemp: its folder is mode 0700, and the rename below would keep that.
    tmp = temp_folder(out)
    tmp.mkdir()  # the umask's mode, like any folder the user makes
    try:
        files = write(tmp)
        os.replace(tmp, out)  # rename(2) may replace an empty folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return files


def save_last_in_hf(step_dir: str, dtype: str) -> Path:
    """checkpoint.last_save_in_hf: the HF export of the checkpoint just saved at the run's last
    step, into <step_dir>/hf (what convert_checkpoint.py --to hf writes). Rank 0 only: the
    other ranks do not wait for it (a long export would outlast their collective timeout)."""
    out = Path(step_dir) / LAST_SAVE_HF
    if out.exists():  # a re-save of the last step (a resumed run with nothing left to train)
        shutil.rmtree(out)

    def export(tmp: Path) -> list[str]:
        return to_hf(Path(step_dir), tmp, None, dtype, 5.0, None)

    files = write_folder(out, export)
    logger.info(f"saved the last step in HF format ({dtype}): {out} ({', '.join(files)})")
    return out
