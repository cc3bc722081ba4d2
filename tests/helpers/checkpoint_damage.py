"""Damage one saved tensor of a DCP checkpoint in place: the files stay readable, the values
turn NaN (what silent disk or copy corruption looks like)."""

import io
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp


def poison_saved_tensor(step_dir: Path, key: str) -> None:
    """Overwrites the first element of the saved tensor `key` (its first shard) with NaN bytes."""
    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata()
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == key)
    path = step_dir / info.relative_path
    raw = bytearray(path.read_bytes())
    item = bytes(raw[info.offset : info.offset + info.length])  # one torch.save'd tensor
    tensor = torch.load(io.BytesIO(item), weights_only=True)
    assert tensor.dtype == torch.float32, tensor.dtype
    start = info.offset + item.index(tensor.flatten().numpy().tobytes())
    raw[start : start + 4] = b"\xff\xff\xff\xff"  # a float32 NaN
    path.write_bytes(bytes(raw))
