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
import math
import os
import shutil
import sys
import warnings
from pathlib import Path


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

import torch.distributed.checkpoint as dcp

from torchtitan_ablate.components.checkpoint.hf import SafetensorsFolder
from torchtitan_ablate.components.checkpoint.hf_export import (
    check_new_folder,
    hf_folder_args,
    to_hf,
    write_folder,
)
from torchtitan_ablate.models.registry import state_dict_adapter


def to_dcp(hf_dir: Path, out_dir: Path) -> list[str]:
    args = hf_folder_args(hf_dir)
    folder = SafetensorsFolder(hf_dir)
    hf_sd = {k: folder.read(k, (slice(None),)) for k in folder.file_of}
    native = state_dict_adapter(args).from_hf(hf_sd)  # a tied entry: its source's tensor
    dcp.save(native, checkpoint_id=str(out_dir), no_dist=True)
    shutil.copy(hf_dir / "config.json", out_dir / "config.json")
    return sorted(os.listdir(out_dir))


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
