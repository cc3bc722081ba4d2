"""Hugging Face Qwen3 / Qwen3-MoE checkpoints: read straight into a sharded model, write for
transformers' from_pretrained.

Reading (`load_hf_weights`): the folder's config.json gives the sizes, its *.safetensors (one
file, or shards listed in model.safetensors.index.json) the weights. Every name and shape is
checked against the model before any data is read (one ConfigError listing all problems). Then
each rank reads, tensor by tensor, only the part it holds: the rows of its FSDP Shard(0) chunk,
the experts of its EP range (per-expert hub tensors, or a slice of the fused ones), through
safetensors' lazy `get_slice`; nothing is materialised in full unless a placement cannot be
expressed as one slice (then that one tensor is read whole and its local part kept).

Writing (`save_hf_checkpoint`): config.json + model.safetensors, or model-0000k-of-0000n shards
with model.safetensors.index.json above `max_shard_bytes`; hub expert layout (per-expert
tensors, what the hub holds and transformers' save_pretrained writes).

LoRA adapters and the expert bias have no HF counterpart: loading leaves them as initialised.
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

from torchtitan_ablate.config import ConfigError
from torchtitan_ablate.models.qwen3.args import Qwen3ModelArgs
from torchtitan_ablate.models.qwen3.sizes import hf_model_args, read_hf_config
from torchtitan_ablate.models.qwen3.state_dict_adapter import (
    BLOCK_KEYS,
    DENSE_KEYS,
    HUB_EXPERT,
    Qwen3StateDictAdapter,
    check_keys,
)

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
Region = tuple[slice, ...]


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
        args, layout, folder = _checked_folder(model_sd, path)
    except (ValueError, KeyError, OSError) as e:
        # Every rank reads the same folder and model config, so every rank stops here alike.
        raise ConfigError(
            f"checkpoint.initial_load_path = {str(path)!r} (initial_load_format = 'hf'): {e}"
        ) from None
    wanted = {k: v for k, v in model_sd.items() if not _skipped(k)}
    for key, tensor in wanted.items():
        reader = _reader(key, args, layout, folder)
        with torch.no_grad():
            _fill(tensor, reader)


def _checked_folder(
    model_sd: dict[str, torch.Tensor], path: str | os.PathLike
) -> tuple[Qwen3ModelArgs, str, SafetensorsFolder]:
    """(sizes, expert layout, tensors) of the folder once its names and shapes match both its
    config.json and the model; ValueError naming every problem otherwise."""
    args = hf_model_args(path)
    adapter = Qwen3StateDictAdapter(args)
    try:
        folder = SafetensorsFolder(path)
        available = folder.shapes()
    except SafetensorError as e:  # a truncated or foreign file
        raise ValueError(f"cannot read its *.safetensors: {e}") from None
    layout = "fused" if any(k.endswith("mlp.experts.down_proj") for k in available) else "hub"
    expected = adapter.hf_shapes(layout)
    optional = set()
    if args.tie_embeddings:  # a tied checkpoint may still carry lm_head; it is not read
        expected["lm_head.weight"] = (args.vocab_size, args.dim)
        optional.add("lm_head.weight")
    meta = {k: torch.empty(s, device="meta") for k, s in available.items()}
    check_keys(meta, expected, optional, f"HF checkpoint {path} ({layout} layout)")
    wanted = {k: v for k, v in model_sd.items() if not _skipped(k)}
    native = {k: s for k, s in adapter.native_shapes().items() if not _skipped(k)}
    model_meta = {k: torch.empty(v.shape, device="meta") for k, v in wanted.items()}
    try:
        check_keys(model_meta, native, set(), f"model vs HF checkpoint {path} config.json")
    except ValueError as e:
        raise ValueError(
            f"{e}; the checkpoint is another model than model.flavor (and its overrides) "
            "describes: use model.flavor = 'auto' or the matching flavor"
        ) from None
    return args, layout, folder


def _skipped(key: str) -> bool:
    """Native entries with no HF counterpart (they keep their initial values)."""
    return ".lora_" in key or key.endswith("moe.expert_bias")


def _reader(
    key: str, args: Qwen3ModelArgs, layout: str, folder: SafetensorsFolder
) -> Callable[[Region], torch.Tensor]:
    """A function giving any region (global coordinates) of our tensor `key` from the HF files."""
    simple = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
    }
    simple["output.weight"] = (
        "model.embed_tokens.weight" if args.tie_embeddings else "lm_head.weight"
    )
    if key not in simple:
        _, n, suffix = key.split(".", 2)
        theirs = f"model.layers.{n}."
        names = {**BLOCK_KEYS, **DENSE_KEYS, "moe.router.gate.weight": "mlp.gate.weight"}
        if suffix in names:
            simple[key] = theirs + names[suffix]
        else:  # routed experts: moe.experts.w1 / w2 / w3
            return _expert_reader(theirs, suffix.rsplit(".", 1)[1], args, layout, folder)
    return lambda region: folder.read(simple[key], region)


def _expert_reader(
    prefix: str, w: str, args: Qwen3ModelArgs, layout: str, folder: SafetensorsFolder
) -> Callable[[Region], torch.Tensor]:
    if layout == "hub":  # one 2-D tensor per expert: read only the experts of the region

        def read_hub(region: Region) -> torch.Tensor:
            experts = range(args.num_experts)[region[0]]
            name = HUB_EXPERT[w]
            parts = [
                folder.read(f"{prefix}mlp.experts.{e}.{name}.weight", region[1:]) for e in experts
            ]
            if parts:
                return torch.stack(parts)
            rest = [len(range(n)[r]) for n, r in zip(_expert_shape(w, args)[1:], region[1:])]
            return torch.empty(0, *rest)

        return read_hub
    if w == "w2":
        return lambda region: folder.read(prefix + "mlp.experts.down_proj", region)
    shift = 0 if w == "w1" else args.moe_hidden_dim  # gate_up_proj = [gate; up] along dim 1

    def read_fused(region: Region) -> torch.Tensor:
        rows = range(args.moe_hidden_dim)[region[1]]
        fused_rows = slice(rows.start + shift, rows.stop + shift)
        return folder.read(prefix + "mlp.experts.gate_up_proj", (region[0], fused_rows, region[2]))

    return read_fused


def _expert_shape(w: str, args: Qwen3ModelArgs) -> tuple[int, int, int]:
    e, i, d = args.num_experts, args.moe_hidden_dim, args.dim
    return (e, d, i) if w == "w2" else (e, i, d)


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
    args: Qwen3ModelArgs,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    source_dir: str | os.PathLike | None = None,
) -> list[str]:
    """Writes a from_pretrained-loadable folder from a full native state dict (adapters merged
    beforehand). source_dir: the HF folder training started from; its tokenizer and generation
    files are copied and its config.json keys kept where ours has none. Returns the files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_sd = Qwen3StateDictAdapter(args).to_hf(native_sd, layout="hub")
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
        weight_map.update(dict.fromkeys(shard, name))
    if len(shards) > 1:
        total = sum(t.numel() * dtype.itemsize for t in hf_sd.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config = read_hf_config(source_dir) if source_dir else {}
    config.pop("num_local_experts", None)  # ours says num_experts (the hub spelling)
    dtype_name = str(dtype).removeprefix("torch.")
    config.update(args.to_hf_config(), torch_dtype=dtype_name, dtype=dtype_name)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for side in SIDE_FILES if source_dir else ():
        if (Path(source_dir) / side).is_file():
            shutil.copy(Path(source_dir) / side, out / side)
    return sorted(os.listdir(out))
