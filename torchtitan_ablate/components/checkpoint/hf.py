"""Hugging Face checkpoints: read straight into a sharded model, write for transformers'
from_pretrained. The names and layouts are the model family's (its state-dict adapter, found by
the config.json's model_type or by the sizes: models/registry.py).

Reading (`load_hf_weights`): the folder's config.json gives the sizes, its *.safetensors (one
file, or shards listed in model.safetensors.index.json) the weights. Every name and shape is
checked against the model before any data is read (one ConfigError listing all problems). Then
each rank reads, tensor by tensor, only the part it holds: the rows of its FSDP Shard(0) chunk,
the experts of its EP range (the adapter's reader slices them), through safetensors' lazy
`get_slice`; nothing is materialised in full unless a placement cannot be expressed as one
slice (then that one tensor is read whole and its local part kept).

Writing (`save_hf_checkpoint`): config.json + model.safetensors, or model-0000k-of-0000n shards
with model.safetensors.index.json above `max_shard_bytes`, in the layout the hub holds.

LoRA adapters, and entries the adapter names as having no HF counterpart (Qwen3-MoE's expert
bias), are not in HF checkpoints: loading leaves them as initialised.
"""

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchtitan_ablate.components.checkpoint.export_folder import as_umask_allows
from torchtitan_ablate.config import ConfigError
from torchtitan_ablate.models.common.state_dict import check_keys
from torchtitan_ablate.models.hf_config import read_hf_config
from torchtitan_ablate.models.registry import hf_model_args, state_dict_adapter
from torchtitan_ablate.models.spec import Region, StateDictAdapter

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Copied from the source HF folder on export when present, so the export is a usable model.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "generation_config.json",
)


class SafetensorsFolder:
    """Lazy, slice-level access to the tensors of one HF folder (single file or sharded)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{index} has no valid weight_map ({e!r})") from None
        elif (self.path / SINGLE_FILE).is_file():
            with safe_open(self.path / SINGLE_FILE, "pt") as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
        else:
            raise ValueError(f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        self.file_of: dict[str, str] = weight_map
        self._open: dict[str, Any] = {}

    def _handle(self, key: str) -> Any:
        name = self.file_of[key]
        if name not in self._open:
            self._open[name] = safe_open(self.path / name, "pt")
        return self._open[name]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(self._handle(k).get_slice(k).get_shape()) for k in self.file_of}

    def read(self, key: str, region: Region) -> torch.Tensor:
        return self._handle(key).get_slice(key)[region]


def load_hf_weights(model_sd: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Fills `model_sd` (our FQNs -> tensors or DTensor shards, e.g. get_model_state_dict of a
    sharded model) in place from the HF folder `path`; each rank reads only its part."""
    try:
        adapter, layout, folder = _checked_folder(model_sd, path)
    except (ValueError, KeyError, OSError) as e:
        # Every rank reads the same folder and model config, so every rank stops here alike.
        raise ConfigError(
            f"checkpoint.initial_load_path = {str(path)!r} (initial_load_format = 'hf'): {e}"
        ) from None
    for key, tensor in model_sd.items():
        if not _skipped(key, adapter):
            with torch.no_grad():
                _fill(tensor, adapter.hf_reader(key, layout, folder.read))


def _checked_folder(
    model_sd: dict[str, torch.Tensor], path: str | os.PathLike
) -> tuple[StateDictAdapter, str, SafetensorsFolder]:
    """(the conversion, its layout, tensors) of the folder once its names and shapes match both
    its config.json and the model; ValueError naming every problem otherwise."""
    adapter = state_dict_adapter(hf_model_args(path))
    try:
        folder = SafetensorsFolder(path)
        available = folder.shapes()
    except SafetensorError as e:  # a truncated or foreign file
        raise ValueError(f"cannot read its *.safetensors: {e}") from None
    layout = adapter.hf_layout(available)
    expected, optional = adapter.hf_accepted(layout)
    meta = {k: torch.empty(s, device="meta") for k, s in available.items()}
    check_keys(meta, expected, optional, f"HF checkpoint {path} ({layout} layout)")
    wanted = {k: v for k, v in model_sd.items() if not _skipped(k, adapter)}
    native = {k: s for k, s in adapter.native_shapes().items() if not _skipped(k, adapter)}
    model_meta = {k: torch.empty(v.shape, device="meta") for k, v in wanted.items()}
    try:
        check_keys(model_meta, native, set(), f"model vs HF checkpoint {path} config.json")
    except ValueError as e:
        raise ValueError(
            f"{e}; the checkpoint is another model than model.flavor (and its overrides) "
            "describes: use model.flavor = 'auto' or the matching flavor"
        ) from None
    return adapter, layout, folder


def _skipped(key: str, adapter: StateDictAdapter) -> bool:
    """Native entries with no HF counterpart (they keep their initial values)."""
    return ".lora_" in key or adapter.no_hf_counterpart(key)


def _fill(tensor: torch.Tensor, read: Callable[[Region], torch.Tensor]) -> None:
    """Copies this rank's part of the global tensor into `tensor` (a DTensor's local shard)."""
    if not isinstance(tensor, DTensor):
        tensor.copy_(read(tuple(slice(0, n) for n in tensor.shape)))
        return
    local = tensor.to_local()
    if all(type(p) is Shard or p.is_replicate() for p in tensor.placements):
        shape, offset = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        region = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        local.copy_(read(region))
        return
    # e.g. _StridedShard (two shardings of one dim): read whole, keep the local part.
    full = read(tuple(slice(0, n) for n in tensor.shape)).to(local.device, local.dtype)
    part = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None)
    local.copy_(part.to_local())


def save_hf_checkpoint(
    native_sd: dict[str, torch.Tensor],
    args: Any,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    source_dir: str | os.PathLike | None = None,
) -> list[str]:
    """Writes a from_pretrained-loadable folder from a full native state dict (adapters merged
    beforehand). source_dir: the HF folder training started from; its tokenizer and generation
    files are copied and its config.json keys kept where ours has none. args: the model's
    sizes, in its family's args class. Returns the files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    adapter = state_dict_adapter(args)
    hf_sd = adapter.to_hf(native_sd)
    dtype = dtype or next(iter(hf_sd.values())).dtype
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in hf_sd.items():
        nbytes = t.numel() * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]  # fmt: skip
    weight_map = {}
    for name, shard in zip(names, shards):
        # Own contiguous copies: safetensors refuses tensors that share storage (expert views).
        tensors = {k: t.detach().to("cpu", dtype).contiguous().clone() for k, t in shard.items()}
        save_file(tensors, out / name, metadata={"format": "pt"})
        as_umask_allows(out / name)  # safetensors writes 0600
        weight_map.update(dict.fromkeys(shard, name))
    if len(shards) > 1:
        total = sum(t.numel() * dtype.itemsize for t in hf_sd.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config = adapter.hf_config(read_hf_config(source_dir) if source_dir else None)
    dtype_name = str(dtype).removeprefix("torch.")
    config.update(torch_dtype=dtype_name, dtype=dtype_name)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for side in SIDE_FILES if source_dir else ():
        if (Path(source_dir) / side).is_file():
            shutil.copy(Path(source_dir) / side, out / side)
    return sorted(os.listdir(out))
