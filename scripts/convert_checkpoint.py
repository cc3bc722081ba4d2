"""Convert checkpoints between our DCP format and Hugging Face safetensors (one process, CPU).

    python scripts/convert_checkpoint.py --to hf  DCP_DIR OUT_DIR [--flavor F] [--dtype bfloat16]
    python scripts/convert_checkpoint.py --to dcp HF_DIR  OUT_DIR

--to hf   DCP_DIR is a training checkpoint (`<dump_folder>/checkpoint/step-N`, only the model
          entries are read) or a model-only DCP folder. The sizes come from --flavor (a flavor
          name, or a folder / config.json of an HF model), else from the run's config.toml found
          next to the checkpoint (`<dump_folder>/config.toml`), else from a config.json inside
          DCP_DIR. LoRA adapters are merged into the base weights ((alpha / r) * B @ A, alpha
          from the run's [lora] section or --lora_alpha). Writes config.json + model.safetensors
          (sharded with an index above --max_shard_gib) that transformers' from_pretrained loads;
          the tokenizer files of the run's HF starting point are copied when known.
--to dcp  Writes a model-only DCP checkpoint plus the HF config.json (so model.flavor = "auto"
          works with checkpoint.initial_load_path = OUT_DIR, initial_load_format = "dcp").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable from a fresh clone without installing the package

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: E402

from torchtitan_ablate.components.hf_checkpoint import (  # noqa: E402
    SafetensorsFolder,
    hf_model_args,
    save_hf_checkpoint,
)
from torchtitan_ablate.models.common.lora import merge_lora_state_dict  # noqa: E402
from torchtitan_ablate.models.qwen3 import (  # noqa: E402
    Qwen3ModelArgs,
    Qwen3StateDictAdapter,
    qwen3_flavors,
)


def find_run_config(dcp_dir: Path) -> dict | None:
    """The config.toml of the run that wrote dcp_dir (its dump folder is 1-3 levels up)."""
    for parent in [dcp_dir, *list(dcp_dir.resolve().parents)[:3]]:
        if (parent / "config.toml").is_file():
            return tomllib.loads((parent / "config.toml").read_text())
    return None


def resolve_args(flavor: str | None, run: dict | None, dcp_dir: Path) -> Qwen3ModelArgs:
    model = (run or {}).get("model", {})
    ckpt = (run or {}).get("checkpoint", {})
    name = flavor or model.get("flavor")
    if name in qwen3_flavors:
        args = qwen3_flavors[name]
    elif name and name != "auto":
        path = Path(name)
        args = Qwen3ModelArgs.from_hf_config(json.loads(path.read_text())) if path.is_file() else (
            hf_model_args(path)
        )  # fmt: skip
    elif name == "auto" and ckpt.get("initial_load_path"):
        args = hf_model_args(ckpt["initial_load_path"])
    elif (dcp_dir / "config.json").is_file():
        args = hf_model_args(dcp_dir)
    else:
        raise SystemExit(
            f"cannot tell the model sizes of {dcp_dir}: pass --flavor (a flavor name or an HF "
            "folder / config.json), or keep the run's config.toml next to the checkpoint"
        )
    if model.get("vocab_size", -1) > 0:
        args = dataclasses.replace(args, vocab_size=model["vocab_size"])
    return args


def read_dcp_model(dcp_dir: Path, args: Qwen3ModelArgs) -> dict[str, torch.Tensor]:
    """The model entries (base weights and LoRA adapters) of a DCP checkpoint, as full tensors."""
    metadata = dcp.FileSystemReader(str(dcp_dir)).read_metadata()
    expected = Qwen3StateDictAdapter(args).native_shapes()
    state = {}
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata) and (key in expected or ".lora_" in key):
            state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp.load(state, checkpoint_id=str(dcp_dir), no_dist=True)
    if args.tie_embeddings:
        state.pop("output.weight", None)
    return state


def to_hf(dcp_dir: Path, out_dir: Path, flavor: str | None, dtype: str | None,
          max_shard_gib: float, lora_alpha: float | None) -> list[str]:  # fmt: skip
    run = find_run_config(dcp_dir)
    args = resolve_args(flavor, run, dcp_dir)
    state = read_dcp_model(dcp_dir, args)
    if any(".lora_" in k for k in state):
        alpha = lora_alpha if lora_alpha is not None else (run or {}).get("lora", {}).get("alpha")
        if alpha is None:
            raise SystemExit(
                "the checkpoint holds LoRA adapters: pass --lora_alpha (no config.toml)"
            )
        state = merge_lora_state_dict(state, float(alpha))
    ckpt = (run or {}).get("checkpoint", {})
    source = ckpt.get("initial_load_path") if ckpt.get("initial_load_format") == "hf" else None
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


def to_dcp(hf_dir: Path, out_dir: Path) -> list[str]:
    args = hf_model_args(hf_dir)
    folder = SafetensorsFolder(hf_dir)
    hf_sd = {k: folder.read(k, (slice(None),)) for k in folder.file_of}
    native = Qwen3StateDictAdapter(args).from_hf(hf_sd)  # tied: output.weight is the embedding
    dcp.save(native, checkpoint_id=str(out_dir), no_dist=True)
    shutil.copy(hf_dir / "config.json", out_dir / "config.json")
    return sorted(os.listdir(out_dir))


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--to", choices=["hf", "dcp"], required=True)
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--flavor", help="flavor name, or an HF folder / config.json (--to hf)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="--to hf dtype")
    p.add_argument("--max_shard_gib", type=float, default=5.0)
    p.add_argument("--lora_alpha", type=float, help="LoRA alpha when no config.toml is found")
    a = p.parse_args(argv)
    if not a.src.is_dir():
        raise SystemExit(f"{a.src} is not a folder")
    if a.to == "hf":
        files = to_hf(a.src, a.out, a.flavor, a.dtype, a.max_shard_gib, a.lora_alpha)
    else:
        files = to_dcp(a.src, a.out)
    print(f"wrote {a.out}: {', '.join(files)}")
    return files


if __name__ == "__main__":
    main()
