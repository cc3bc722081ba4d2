"""training.epochs -> training.steps: one pass over the data in the unit a step consumes.

The data is read and tokenized once at start-up, every file from the start and every shard's
documents, so each rank counts the same and derives the same steps without a collective:

  text, greedy packing   tokens: each document's tokens and its EOS (the packed stream);
                         a step trains global batch x seq_len of them
  padding packing        rows: one per usable document (text document, conversation, pair);
                         a step takes global batch rows
  chat / preference,     rows: the packer's own rows (sft.SFTDataset.add) of each data-parallel
  greedy or best_fit     rank x loader worker's conversations in file order, an open row at
                         the end included; a step takes global batch rows

steps = ceil(epochs x per pass / per step) (a fractional last step rounds up, as HF's trainer
does), at least 1. A mixture counts all of its sources (a pass then holds the sources' tokens,
drawn by weight); a shuffle buffer can move a chat packer's count by a few rows.
"""

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torchtitan_ablate.components.data.datasets import TextDocuments, list_text_files
from torchtitan_ablate.components.data.errors import KEY, DatasetError
from torchtitan_ablate.components.data.preference import PreferenceDataset, PreferencePairs
from torchtitan_ablate.components.data.sft import ChatDocuments, SFTDataset
from torchtitan_ablate.components.text.tokenizer import Tokenizer
from torchtitan_ablate.config.derived import ceil_of
from torchtitan_ablate.config.job_config import Training


@dataclass
class EpochSteps:
    """What training.epochs came to, and how it was counted (for the log line)."""

    steps: int
    per_pass: int
    per_step: int
    unit: str
    seconds: float

    def describe(self, epochs: float) -> str:
        return (
            f"training.epochs = {epochs:g}: {self.per_pass:,} {self.unit} per pass over the data "
            f"(counted in {self.seconds:.1f} s), {self.per_step:,} per step -> training.steps = "
            f"{self.steps:,}"
        )


def num_epoch_steps(
    data: Training,
    tokenizer: Tokenizer,
    sequences_per_step: int,
    num_shards: int,
    max_bad_rows: int = 0,
) -> EpochSteps:
    """The steps of data.epochs passes. sequences_per_step: the global batch; num_shards: the
    document shards of the loader (data-parallel ranks x loader workers), which chat packing
    packs apart; max_bad_rows: dpo's."""
    assert data.epochs is not None and data.dataset != "synthetic", data  # config rules
    start = time.perf_counter()
    if data.dataset == "text" and data.packing == "greedy":
        unit, per_step = "tokens", sequences_per_step * data.seq_len
        per_pass = sum(len(doc) + 1 for doc in _items(data, tokenizer, max_bad_rows))
    elif data.packing == "padding":
        unit, per_step = "rows", sequences_per_step
        per_pass = sum(1 for _ in _items(data, tokenizer, max_bad_rows))
    else:
        unit, per_step = "rows", sequences_per_step
        per_pass = _packed_rows(data, tokenizer, num_shards, max_bad_rows)
    if per_pass == 0:  # the loader's own checks say so first, where it is built
        raise DatasetError(f"{KEY}: no usable document to count training.epochs over")
    steps = max(-(-ceil_of(data.epochs, per_pass) // per_step), 1)
    return EpochSteps(steps, per_pass, per_step, unit, time.perf_counter() - start)


def _items(data: Training, tokenizer: Tokenizer, max_bad_rows: int) -> Iterator[Any]:
    """The items of one pass over each source (a mixture's several, one after the other)."""
    paths = data.dataset_path if isinstance(data.dataset_path, list) else [data.dataset_path]
    for path in paths:
        for _, item in _source(data, path, tokenizer, max_bad_rows).one_pass():
            yield item


def _source(
    data: Training, path: str | None, tokenizer: Tokenizer, max_bad_rows: int
) -> TextDocuments:
    """A fresh source of `path`, as build_dataloader makes it."""
    files = list_text_files(path, data.dataset)
    if data.dataset == "chat":
        return ChatDocuments(files, tokenizer, data.seq_len)
    if data.dataset == "preference":
        return PreferencePairs(files, tokenizer, data.seq_len, max_bad_rows)
    return TextDocuments(files, tokenizer, data.dataset_text_field)


def _packed_rows(data: Training, tokenizer: Tokenizer, num_shards: int, max_bad_rows: int) -> int:
    """Rows the chat / preference packer makes of one pass, each shard's documents apart."""
    assert isinstance(data.dataset_path, str), data.dataset_path  # a mixture is text only
    source = _source(data, data.dataset_path, tokenizer, max_bad_rows)
    packer_cls = PreferenceDataset if data.dataset == "preference" else SFTDataset
    packers = [packer_cls(source, data.seq_len, data.packing, 0, 0, 1) for _ in range(num_shards)]
    rows = 0
    for index, item in source.one_pass():
        rows += sum(1 for _ in packers[index % num_shards].add(item))
    return rows + sum(len(p.open_rows) for p in packers)
