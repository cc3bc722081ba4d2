"""Document sources: infinite, deterministic, sharded, resumable streams of token lists.

A source yields one tokenized document (list[int], without EOS) at a time. Sharding is by
document: with `num_shards` shards (dp ranks x loader workers), shard s keeps the documents whose
global index i satisfies i % num_shards == s, so shards are disjoint and together cover the data.
Every shard reads every file's lines, but decodes and tokenizes only its own documents. Resuming
is exact only with the same shard layout.

Text formats (files, or folders searched recursively in sorted path order):
  .jsonl    one document per non-blank line, {"text": "..."} (other keys ignored)
  .txt      one document per paragraph; paragraphs are separated by one or more blank lines
  .parquet  one document per row, read by row group (parquet.py; needs pyarrow)
"text" is training.dataset_text_field. Files are read in the same order every epoch; mixing.py
adds a shuffle buffer and weighted mixtures on top. Every line is checked once before training
(TextDocuments.check_lines; parquet: the column's type and that its row groups read); a shard
that runs out of documents starts over with one warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from torchtitan_ablate.components.data.errors import KEY, DatasetError
from torchtitan_ablate.components.data.parquet import check_parquet, parquet_rows, require_pyarrow
from torchtitan_ablate.components.text.tokenizer import Tokenizer

TEXT_SUFFIXES = (".txt", ".jsonl")
PARQUET = ".parquet"  # dataset = "text" only: chat rows are nested, read from .jsonl
# How much data check_lines reads before training: all of it up to here (a few seconds of JSON
# parsing per GiB), the first part of a larger corpus (the rest is checked as it is read).
CHECK_BYTES = 2**30

logger = logging.getLogger("torchtitan_ablate")


class SyntheticDocuments:
    """Random-token documents of random length in [1, 2 * seq_len]; never ends. doc_len > 0:
    every document doc_len - 1 tokens (the packer's EOS makes doc_len).

    Document k of shard s is a pure function of (seed, s, k), so the state is just k.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int, doc_len: int = 0) -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.doc_len = doc_len
        self.shard, self.num_shards = 0, 1
        self.doc_idx = 0

    def set_shard(self, shard: int, num_shards: int) -> None:
        self.shard, self.num_shards = shard, num_shards

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            key = f"{self.seed}/{self.shard}/{self.num_shards}/{self.doc_idx}".encode()
            seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
            gen = torch.Generator().manual_seed(seed)
            if self.doc_len > 0:
                length = self.doc_len - 1
            else:
                length = int(torch.randint(1, 2 * self.seq_len + 1, (1,), generator=gen))
            self.doc_idx += 1  # advance before yielding: state always means "consumed"
            yield torch.randint(0, self.vocab_size, (length,), generator=gen).tolist()

    def state_dict(self) -> dict[str, Any]:
        return {"doc_idx": self.doc_idx}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.doc_idx = state["doc_idx"]


def list_text_files(path: str | None, dataset: str = "text") -> list[Path]:
    """The data files under `path` (a file or folder), sorted; DatasetError if none. Text data
    reads .txt/.jsonl/.parquet files, chat data .txt/.jsonl (sft.py then keeps .jsonl only)."""
    suffixes = TEXT_SUFFIXES + ((PARQUET,) if dataset == "text" else ())
    kinds = "/".join(suffixes)
    if not path:
        raise DatasetError(
            f"{KEY} is not set: training.dataset = {dataset!r} needs a {kinds} file or folder"
        )
    p = Path(path)
    if p.is_dir():
        files = sorted(
            f
            for f in p.rglob("*")
            if f.is_file() and f.suffix in suffixes and not f.name.startswith(".")
        )
        if not files:
            raise DatasetError(f"{KEY} = {path!r}: the folder holds no {kinds} files")
    elif p.is_file():
        if p.suffix not in suffixes:
            raise DatasetError(
                f"{KEY} = {path!r}: not a {kinds} file; convert it to "
                '.jsonl ({"text": ...} per line) or .txt (blank-line separated paragraphs)'
            )
        files = [p]
    else:
        raise DatasetError(f"{KEY} = {path!r}: no such file or folder")
    for f in files:
        try:
            with open(f, "rb") as fh:
                fh.read(1)
        except OSError as e:
            raise DatasetError(f"{KEY}: cannot read {f}: {e.strerror}") from None
        if f.suffix == PARQUET:
            require_pyarrow(f)  # fails here, before the model is built, naming the install
    return files


class TextDocuments:
    """Documents from .txt/.jsonl/.parquet files, re-looped over epochs, resumable mid-file.

    State: epoch, file index, byte offset and line number in that file, global document index.
    Files are read in binary mode so the byte offset can be saved and seeked to on resume.
    """

    def __init__(self, files: list[Path], tokenizer: Tokenizer, text_field: str = "text") -> None:
        self.files, self.tokenizer, self.text_field = files, tokenizer, text_field
        self.shard, self.num_shards = 0, 1
        self.epoch, self.file_idx, self.offset, self.line_no, self.doc_idx = 0, 0, 0, 0, 0
        self.warned_repeat = False  # per process, not state: one warning per run

    def set_shard(self, shard: int, num_shards: int) -> None:
        self.shard, self.num_shards = shard, num_shards

    # What an item is and what a shard without any is called; the chat dataset overrides both.
    empty_item_name = "non-empty document"

    def _to_item(self, path: Path, raw: bytes | str, first_line: int) -> list[int] | None:
        """This shard's raw document as an item to yield, or None to skip it."""
        return self.tokenizer.encode(_decode(path, raw, first_line, self.text_field)) or None

    def _check_line(self, path: Path, raw: bytes, line_no: int) -> None:
        """DatasetError (one line naming file and line) when a line cannot be read."""
        _decode(path, raw, line_no, self.text_field)

    def check_lines(self, max_bytes: int = CHECK_BYTES) -> bool:
        """Reads every non-blank line once, before the model is built, so that a bad line stops
        the run at start-up (on every rank alike) instead of steps into it; True when all of
        the data was checked, False when it stopped after max_bytes. Text without a document
        (an empty file, blank lines only) is a DatasetError here too."""
        left, documents = max_bytes, False
        for path in self.files:
            if path.suffix == PARQUET:  # typed columns: the schema, and that the pages read
                used = check_parquet(path, self.text_field, left)
                if used is None:
                    return False
                left -= used
                continue
            with _open(path) as fh:
                for line_no, line in enumerate(fh, 1):
                    if left <= 0:
                        return False
                    left -= len(line)
                    if line.strip():
                        documents = True
                        self._check_line(path, line, line_no)
        if not documents and not any(p.suffix == PARQUET for p in self.files):
            raise DatasetError(self._no_item_message())
        return True

    def __iter__(self) -> Iterator:
        while True:
            fresh_epoch, yielded, tokens = self.file_idx == 0 and self.offset == 0, False, 0
            while self.file_idx < len(self.files):
                path = self.files[self.file_idx]
                for raw, first_line, last_line, end in self._raw_docs(path):
                    mine = self.doc_idx % self.num_shards == self.shard
                    self.doc_idx, self.offset, self.line_no = self.doc_idx + 1, end, last_line
                    if mine:  # only this shard's documents are decoded and tokenized
                        item = self._to_item(path, raw, first_line)
                        if item is not None:
                            yielded = True
                            tokens += len(item[0] if isinstance(item, tuple) else item)
                            yield item
                self.file_idx, self.offset, self.line_no = self.file_idx + 1, 0, 0
            if fresh_epoch and not yielded:  # else this shard would loop forever, yielding nothing
                raise DatasetError(self._no_item_message())
            if not self.warned_repeat:
                self.warned_repeat = True
                logger.warning(self._repeat_message(tokens if fresh_epoch else None))
            self.epoch, self.file_idx, self.doc_idx = self.epoch + 1, 0, 0

    def one_pass(self) -> Iterator[tuple[int, Any]]:
        """(document index, item) of each usable document of one pass over the files, every
        shard's, from the start: what training.epochs counts (epochs.py). The reading
        position is neither used nor moved."""
        index = 0
        for path in self.files:
            for raw, first_line, _, _ in self._raw_docs(path, start=(0, 0)):
                item = self._to_item(path, raw, first_line)
                if item is not None:
                    yield index, item
                index += 1

    def _repeat_message(self, tokens: int | None) -> str:
        where = f"{self.files[0]}{' ...' if len(self.files) > 1 else ''}"
        reader, docs = "the data", f"{self.doc_idx:,}"
        if self.num_shards > 1:
            mine = len(range(self.shard, self.doc_idx, self.num_shards))
            reader = f"shard {self.shard} of {self.num_shards} (data-parallel ranks x workers)"
            docs = f"its {mine:,} of the {self.doc_idx:,}"
        toks = f", {tokens:,} tokens" if tokens is not None else ""
        return (
            f"{where}: {reader} has been read to the end ({docs} documents{toks}) and starts "
            f"over (epoch {self.epoch + 2}): the rest of the run repeats data; give more data "
            "or fewer training.steps to train on each document once"
        )

    def _no_item_message(self) -> str:
        where = f"{KEY}: {self.files[0]}{' ...' if len(self.files) > 1 else ''}"
        if self.doc_idx == 0:
            return f"{where} holds no documents (only blank lines); give a non-empty dataset"
        return (
            f"{where}: shard {self.shard} of {self.num_shards} (data-parallel ranks x "
            f"training.num_workers) got no {self.empty_item_name} out of {self.doc_idx} "
            "documents; give more data or use fewer ranks / loader workers"
        )

    def _raw_docs(
        self, path: Path, start: tuple[int, int] | None = None
    ) -> Iterator[tuple[bytes | str, int, int, int]]:
        """Yield (raw doc, first line, last line read, byte offset after it) from `start`
        (byte offset, line number; default self.offset and self.line_no); for parquet, "line"
        and "offset" both count rows (a null row is an empty document)."""
        offset, line_no = start or (self.offset, self.line_no)
        if path.suffix == PARQUET:  # the caller moves self.offset on as rows are consumed
            for n, text in enumerate(parquet_rows(path, self.text_field, offset), offset + 1):
                yield text or "", n, n, n
            return
        with _open(path) as fh:
            fh.seek(offset)
            para, first = [], 0
            is_txt = path.suffix == ".txt"
            for line in fh:
                offset, line_no = offset + len(line), line_no + 1
                if not line.strip():
                    if para:  # a blank line closes the paragraph
                        yield b"".join(para).rstrip(b"\r\n"), first, line_no, offset
                        para = []
                elif not is_txt:
                    yield line, line_no, line_no, offset
                else:
                    first = first if para else line_no
                    para.append(line)
            if para:
                yield b"".join(para).rstrip(b"\r\n"), first, line_no, offset

    def state_dict(self) -> dict[str, Any]:
        keys = ("epoch", "file_idx", "offset", "line_no", "doc_idx")
        return {k: getattr(self, k) for k in keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.file_idx, self.offset = state["epoch"], state["file_idx"], state["offset"]
        self.line_no, self.doc_idx = state["line_no"], state["doc_idx"]


def _decode(path: Path, raw: bytes | str, line_no: int, field: str = "text") -> str:
    if isinstance(raw, str):  # a parquet value, already text
        return raw
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(
            f"{KEY}: {path}:{line_no}: not valid UTF-8 ({e.reason}); re-encode the file as UTF-8"
        ) from None
    if path.suffix == ".txt":
        return text
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(
            f"{KEY}: {path}:{line_no}: invalid JSON ({e.msg}); each line must be one JSON object"
        ) from None
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        hint = (
            "; this is a chat line: use training.dataset = 'chat'"
            if isinstance(record, dict) and "messages" in record
            else ""
        )
        raise DatasetError(
            f"{KEY}: {path}:{line_no}: JSONL line has no string {json.dumps(field)} field "
            f'(expected {{{json.dumps(field)}: "..."}}; training.dataset_text_field names '
            f"it){hint}"
        )
    return record[field]


def _open(path: Path) -> BinaryIO:
    """path opened for reading bytes, or one DatasetError line naming it."""
    try:
        return open(path, "rb")
    except OSError as e:
        raise DatasetError(f"{KEY}: cannot read {path}: {e.strerror}") from None
