"""What identifies a run's tokenizer and data files, for the checkpoint's record (run_settings.py).

A file is known by its contents, not by its path or modification time: a corpus moved to
another disk is the same data, and a copy of it edited in place is not. The tokenizer file's
contents are hashed whole. Data files are hashed whole up to DATA_HASH_BYTES in all (as much as
the loader checks before training, datasets.CHECK_BYTES); past that budget a file is known by
its size and its first and last MiB (an edit in its middle that keeps its size goes unseen).
The hashes are BLAKE2b, 64 bits: enough to tell versions of one file apart.
"""

import hashlib
from pathlib import Path

from torchtitan_ablate.components.data.datasets import CHECK_BYTES, list_text_files
from torchtitan_ablate.components.text.tokenizer import tokenizer_file
from torchtitan_ablate.config.job_config import Training

DATA_HASH_BYTES = CHECK_BYTES
_CHUNK = 2**20


def tokenizer_identity(path: str) -> str:
    """The hash of the file that model.tokenizer_path names ("byte" for the byte tokenizer)."""
    file = tokenizer_file(path)
    return "byte" if file is None else f"blake2b {_digest(file, file.stat().st_size)}"


def data_files(training: Training) -> list[list]:
    """[path, size in bytes, hash] of each data file, in the order the loader reads them;
    none for synthetic data."""
    if training.dataset == "synthetic":
        return []
    paths = training.dataset_path
    files = [f for p in (paths if isinstance(paths, list) else [paths])
             for f in list_text_files(p, training.dataset)]  # fmt: skip
    out, left = [], DATA_HASH_BYTES
    for f in files:
        size = f.stat().st_size
        whole = size <= left
        left -= size if whole else 0
        digest = _digest(f, size if whole else _CHUNK)
        out.append([str(f), size, f"blake2b {digest}" if whole else f"ends blake2b {digest}"])
    return out


def _digest(path: Path, head: int) -> str:
    """Hash of the file's first `head` bytes, and of its last MiB when that leaves some out."""
    h = hashlib.blake2b(digest_size=8)
    size = path.stat().st_size
    with open(path, "rb") as f:
        left = head
        while left > 0 and (chunk := f.read(min(_CHUNK, left))):
            h.update(chunk)
            left -= len(chunk)
        if head < size:
            f.seek(max(head, size - _CHUNK))
            h.update(f.read())
    return h.hexdigest()
