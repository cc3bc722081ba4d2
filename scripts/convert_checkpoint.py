"""Convert checkpoints between our DCP format and Hugging Face safetensors (one process, CPU).

    python scripts/convert_checkpoint.py --to hf  DCP_DIR OUT_DIR [--flavor F] [--dtype bfloat16]
                                         [--peft PEFT_DIR]
    python scripts/convert_checkpoint.py --to dcp HF_DIR  OUT_DIR

--to hf   DCP_DIR is a training checkpoint (`<dump_folder>/checkpoint/step-N`, only the model
          entries are read) or a model-only DCP folder. The sizes come from --flavor (a flavor
          name, or a folder / config.json of an HF model), else from what the checkpoint records
          of the run that made it (its model sizes, [lora] and weights' source), else (a
          checkpoint that records none) from the run's config.toml next to it
          (`<dump_folder>/config.toml`, which the latest launch wrote: a warning says so), else
          from a config.json inside DCP_DIR. LoRA adapters are merged into the base weights
          ((alpha / r) * B @ A, alpha as recorded; --lora_alpha for a checkpoint that records
          none, a config.toml's [lora] otherwise). Writes config.json + model.safetensors
          (sharded with an index above --max_shard_gib) that transformers' from_pretrained loads;
          the tokenizer files of the run's HF starting point are copied when known.
          --peft PEFT_DIR also writes the adapters unmerged in Hugging Face PEFT's layout
          (adapter_config.json + adapter_model.safetensors, for PeftModel.from_pretrained on
          the base model); adapters on MoE experts have no PEFT layout and are refused.
--to dcp  Writes a model-only DCP checkpoint plus the HF config.json (so model.flavor = "auto"
          works with checkpoint.initial_load_path = OUT_DIR, initial_load_format = "dcp").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--to", choices=["hf", "dcp"], required=True)
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--flavor", help="flavor name, or an HF folder / config.json (--to hf)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="--to hf dtype")
    p.add_argument("--max_shard_gib", type=float, default=5.0)
    p.add_argument("--lora_alpha", type=float, help="LoRA alpha of a checkpoint recording none")
    p.add_argument("--peft", type=Path, metavar="PEFT_DIR", help="also the adapters, PEFT layout")
    a = p.parse_args(argv)
    if a.peft is not None and (a.to != "hf" or a.peft.resolve() == a.out.resolve()):
        p.error("--peft PEFT_DIR needs --to hf and a folder other than OUT_DIR")
    if not (a.max_shard_gib > 0 and math.isfinite(a.max_shard_gib)):
        p.error(f"--max_shard_gib {a.max_shard_gib:g}: the shard size in GiB, more than 0")
    if not a.src.is_dir():
        p.error(f"{a.src} is not a folder")
    return a


if __name__ == "__main__":  # --help and a wrong option answer before torch's imports (seconds)
    parse_args(sys.argv[1:])

import tomllib
import torch
import torch.distributed.checkpoint as dcp

from torchtitan_ablate.components.checkpoint.export_folder import remove_stale, temp_folder
from torchtitan_ablate.components.checkpoint.hf import SafetensorsFolder, save_hf_checkpoint
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


def _hf_args(path: Path) -> Any:
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
        args = _hf_args(Path(name))
    elif name == "auto" and run.get("checkpoint.initial_load_path"):
        args = _hf_args(Path(run["checkpoint.initial_load_path"]))
    elif (dcp_dir / "config.json").is_file():
        args = _hf_args(dcp_dir)
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


def to_dcp(hf_dir: Path, out_dir: Path) -> list[str]:
    args = _hf_args(hf_dir)
    folder = SafetensorsFolder(hf_dir)
    hf_sd = {k: folder.read(k, (slice(None),)) for k in folder.file_of}
    native = state_dict_adapter(args).from_hf(hf_sd)  # a tied entry: its source's tensor
    dcp.save(native, checkpoint_id=str(out_dir), no_dist=True)
    shutil.copy(hf_dir / "config.json", out_dir / "config.json")
    return sorted(os.listdir(out_dir))


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


def main(argv: list[str] | None = None) -> list[str]:
    a = parse_args(argv)

    def convert(tmp: Path) -> list[str]:
        if a.to == "hf":
            return to_hf(a.src, tmp, a.flavor, a.dtype, a.max_shard_gib, a.lora_alpha, a.peft)
        return to_dcp(a.src, tmp)

    try:
        with warnings.catch_warnings():
            # One process by design (no_dist=True); DCP still warns about it on every call.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            if a.peft is not None:  # both outputs are new folders, or neither is written
                check_new_folder(a.peft)
            files = write_folder(a.out, convert)
    except (ValueError, OSError) as e:  # unreadable, mismatching or missing inputs
        print(f"convert_checkpoint: error: {str(e).splitlines()[0][:500]}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {a.out}: {', '.join(files)}")
    if a.peft is not None:
        print(f"wrote {a.peft}: adapter_config.json, adapter_model.safetensors")
    return files


if __name__ == "__main__":
    main()
