"""Reading a DCP checkpoint without running code that a file in it names.

DCP keeps a checkpoint's index (`.metadata`) as a pickle and each non-tensor entry (the step,
the optimizer's param-group settings, this project's pickled states) as a torch.save'd object,
and its FileSystemReader and DefaultLoadPlanner unpickle both with no restriction: a pickle can
name any callable, which runs on load. SafeReader is a FileSystemReader whose reads go through
allow-lists instead:
  - `.metadata`: an Unpickler that resolves only ALLOWED (DCP's metadata classes, torch.Size,
    dtypes, layouts, paths);
  - non-tensor entries: torch.load(weights_only=True), torch's own allow-list; the planner gets
    the object re-serialized, so its unrestricted torch.load only sees what passed;
  - tensors: DCP reads them with weights_only=True already.
`loads` reads this project's pickled states (state.Pickled: data loader, RNG, schedule,
settings) with the same Unpickler, whose ALLOWED also covers CPU tensors (the RNG states).
Anything else is refused with ForeignObject, a ConfigError: one line, exit code 2.

Relied on in DCP (torch 2.11 to 2.13): FileSystemReader's `checkpoint_id` and `read_data(plan,
planner)` handing each non-tensor entry to `planner.load_bytes`;
tests/unit/components/checkpoint/test_safe_reader.py fails when a torch release changes either.
"""

import io
import os
import pickle
import re
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from torchtitan_ablate.config.errors import ConfigError

METADATA = ".metadata"

# (module, name) a checkpoint's pickles may name; torch dtypes ("torch", "float32") too.
ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name
    "torch": {"Size", "device"},
    "torch._utils": {"_rebuild_tensor_v2"},
    "torch.storage": {"_load_from_bytes"},  # resolved to _storage_from_bytes below
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "complex", "slice"},
    "_codecs": {"encode"},  # bytes, as protocol 2 writes them
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
}


class ForeignObject(ConfigError):
    """A checkpoint file names something outside the allow-list."""


def refusal(where: str, what: str) -> ForeignObject:
    return ForeignObject(
        f"{where} holds {what}, which a checkpoint may not hold (loading it could run code): "
        "load DCP checkpoints only from sources you trust, and third-party weights as Hugging "
        'Face safetensors (checkpoint.initial_load_format = "hf")'
    )


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file: io.IOBase, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return lambda data: _storage_from_bytes(data, self.where)
        if name in ALLOWED.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise refusal(self.where, f"{module}.{name}")


def _storage_from_bytes(data: bytes, where: str) -> Any:
    """A tensor's storage as pickle.dumps writes it (a torch.save'd blob inside the pickle)."""
    return _weights_only(io.BytesIO(data), where)


def _weights_only(file: io.IOBase, where: str) -> Any:
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as e:
        # torch names the global it refused: "Unsupported global: GLOBAL posix.system was ..."
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = found.group(1) if found else "an object outside torch's weights-only allow-list"
        raise refusal(where, what) from None


def loads(data: bytes, where: str) -> Any:
    """pickle.loads through the allow-list; ForeignObject naming `where` when it names
    anything else."""
    return _AllowListUnpickler(io.BytesIO(data), where).load()


class SafeReader(FileSystemReader):
    """dcp.FileSystemReader that reads `.metadata` and the non-tensor entries through the
    allow-lists (module doc): `dcp.load(state, storage_reader=SafeReader(path))`.

    `refused`: the ForeignObject it raised, if any. DCP may fold it into an error of its own
    (torch 2.13 retries a failed metadata read with a rank's own file and reports both as an
    AssertionError), so a caller tells a refusal from damage by this, not by DCP's error."""

    refused: ForeignObject | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # torch 2.13: a rank's own metadata file, when one is asked
        name = METADATA if rank is None else f"__{rank}{METADATA}"
        path = os.path.join(str(self.checkpoint_id), name)
        with open(path, "rb") as f:
            metadata = self.refusing(lambda: _AllowListUnpickler(f, path).load())
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        # What FileSystemReader.read_metadata adds after unpickling.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(plan, _CheckedBytes(planner, self))

    def refusing(self, read: Callable[[], Any]) -> Any:
        """read(), keeping a ForeignObject it raises in `refused`."""
        try:
            return read()
        except ForeignObject as e:
            self.refused = self.refused or e
            raise


class _CheckedBytes:
    """The planner as read_data sees it: a non-tensor entry passes the weights-only unpickler
    before the planner gets it; everything else goes to the planner as it is."""

    def __init__(self, planner: Any, reader: SafeReader) -> None:
        self._planner = planner
        self._reader = reader

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        where = f"entry {read_item.dest_index.fqn!r}"
        checked = io.BytesIO()
        torch.save(self._reader.refusing(lambda: _weights_only(value, where)), checked)
        checked.seek(0)
        self._planner.load_bytes(read_item, checked)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)
