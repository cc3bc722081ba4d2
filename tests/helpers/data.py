"""The data-loader tests' shared pieces: a byte-tokenizer text loader with small defaults, row
readers, the exact-resume check and a chat conversation."""

import itertools
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan_ablate.components.data import build_dataloader
from torchtitan_ablate.components.text.tokenizer import build_tokenizer
from torchtitan_ablate.config.job_config import Training

BYTE = build_tokenizer("byte")  # eos 256, bos 257, pad 258
EOS, PAD = BYTE.eos_id, BYTE.pad_id
DOCS = [f"doc{i}:" + "x" * (i % 7) for i in range(12)]  # distinct, lengths 5..12 bytes
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3 plus 3?"},
    {"role": "assistant", "content": "It is 6."},
]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def loader(
    path: Path | str | None,
    dataset: str = "text",
    tokenizer=BYTE,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    **training,
) -> StatefulDataLoader:
    """This dp rank's loader of a [training] section: `training` overrides its keys."""
    data = dict(dataset=dataset, dataset_path=None if path is None else str(path), seq_len=16)
    data |= dict(local_batch_size=2, packing="greedy", seed=0)
    return build_dataloader(Training(**(data | training)), tokenizer, dp_rank, dp_world_size)


def rows(dl: Iterable[dict[str, torch.Tensor]], n: int) -> list[dict[str, torch.Tensor]]:
    """The first n rows (unbatched) of a loader."""
    out = []
    for batch in dl:
        out += [{k: v[i] for k, v in batch.items()} for i in range(len(batch["input_ids"]))]
        if len(out) >= n:
            return out[:n]
    raise AssertionError("loader ended")


def take(it: Iterator[dict[str, torch.Tensor]], n: int) -> list[dict[str, torch.Tensor]]:
    return list(itertools.islice(it, n))


def documents_in(rows_: list[dict[str, torch.Tensor]], packing: str) -> list[str]:
    """Decode the documents a list of rows holds (complete ones only)."""
    if packing == "padding":
        seqs = [r["input_ids"].tolist() for r in rows_]
        return [BYTE.decode(s[: s.index(EOS)]) for s in seqs]
    stream = torch.cat([r["input_ids"] for r in rows_]).tolist()  # windows overlap by one
    return bytes(t if t != EOS else 0 for t in stream).decode().split("\0")[:-1]


def assert_same_rows(want: list[dict], have: list[dict]) -> None:
    """Equal length and, row by row, equal tensors under every key."""
    for i, (w, h) in enumerate(zip(want, have, strict=True)):
        for key in w:
            assert torch.equal(w[key], h[key]), (i, key)


def assert_resumes_exactly(make_loader: Callable[[], object], skip: int, check: int) -> None:
    """A loader restored from its state after `skip` batches yields, key by key, the next
    `check` batches of an uninterrupted one."""
    ref_loader = make_loader()
    ref = iter(ref_loader)
    for _ in range(skip):
        next(ref)
    state = ref_loader.state_dict()
    expected = [next(ref) for _ in range(check)]
    resumed_loader = make_loader()
    resumed_loader.load_state_dict(state)
    resumed = iter(resumed_loader)
    for want in expected:
        got = next(resumed)
        for k in want:
            assert torch.equal(got[k], want[k]), k


def damage_row_group(path: Path, group: int) -> None:
    """Overwrites the text column's pages of one row group of a parquet file in place (its page
    headers no longer parse); the footer, so the schema and row counts, stays intact."""
    import pyarrow.parquet as pq

    chunk = pq.ParquetFile(path).metadata.row_group(group).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(b"\xff" * chunk.total_compressed_size)
