"""Turn a stream of tokenized documents into fixed-length training rows.

Every row is a dict of LongTensors of length S = seq_len:
  input_ids     the tokens fed to the model
  labels        the next token for each position; -100 = ignored by the loss
  document_ids  0, 1, 2, ... : which segment of the row a token belongs to
  positions     index of the token inside its segment (restarts at 0 at every segment start)

greedy   documents are concatenated as d0 EOS d1 EOS ... and cut into windows of S + 1 tokens;
         input = window[:-1], labels = window[1:]. Consecutive windows overlap by one token, so
         every next-token pair of the stream is trained exactly once. An EOS belongs to the
         document it ends. A document cut by a row boundary continues in the next row as segment
         0 with positions restarting at 0: with RoPE only position differences matter inside a
         segment, and positions stay < S.
padding  one document per row: (doc + EOS) truncated to S + 1 tokens (the rest is dropped), then
         padded with pad_id. Labels past the document are -100; the padding is its own segment.

Data-parallel sharding (training.data_sharding):
documents  rank r (and each of its loader workers) reads every (dp x workers)-th document and
           packs only those: cheap, but which rows form a global batch depends on the dp degree.
rows       every rank packs the whole stream into the global row sequence; global micro-batch m
           is rows [m * dp * B, (m + 1) * dp * B), of which rank r keeps the contiguous slice
           [r * B, (r + 1) * B) and loader worker m % workers produces it. The union over ranks is
           the same rows at any dp degree (a 1-rank run with batch dp * B sees exactly them).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan_ablate.components.data.datasets import SyntheticDocuments, TextDocuments
from torchtitan_ablate.components.objective.loss import IGNORE_INDEX

PACKING_MODES = ("greedy", "padding")
SHARDING_MODES = ("documents", "rows")


def segment_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """positions[i] = i - (index of the first token of i's segment); document_ids sorted."""
    idx = torch.arange(document_ids.numel())
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[1:] = document_ids[1:] != document_ids[:-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=0).values
    return idx - first


class PackedDataset(IterableDataset):
    """Packs a document source into rows; stateful (source position + carried-over tokens)."""

    def __init__(
        self,
        source: SyntheticDocuments | TextDocuments,
        seq_len: int,
        packing: str,
        eos_id: int,
        pad_id: int,
        dp_rank: int,
        dp_world_size: int,
        sharding: str = "documents",
        local_batch_size: int = 1,
    ) -> None:
        # The loader checked both (config/rules.py states the rules).
        assert packing in PACKING_MODES and sharding in SHARDING_MODES, (packing, sharding)
        self.source, self.seq_len, self.packing = source, seq_len, packing
        self.eos_id, self.pad_id = eos_id, pad_id
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.sharding, self.local_batch_size = sharding, local_batch_size
        # Carry-over of greedy packing: tokens not yet emitted (less than a window, or an old
        # checkpoint's longer buffer), [document number, token count] runs over them, and the
        # document they are drawn from with the source's state from before it was read. A long
        # document is drawn a window at a time and never enters the loader state: the state a
        # worker sends the main process with every batch stays a few KB (a 200k-token document
        # in it cost the training process ~70 ms of CPU per batch).
        self.buffer: list[int] = []
        self.buffer_runs: list[list[int]] = []
        self.current: list[int] = []
        self.current_pos = 0
        self.before_current: dict[str, Any] | None = None
        self.reread_pos: int | None = None  # a loaded state's position in its current document
        self.docs_seen = 0
        self.rows_seen = 0  # rows sharding: index of the next row in the global row sequence

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.sharding == "rows":
            self.source.set_shard(0, 1)
        else:
            shard_for_this_worker(self.source, self.dp_rank, self.dp_world_size)
        rows = self._greedy() if self.packing == "greedy" else self._padding()
        yield from self._rows_of_this_worker(rows) if self.sharding == "rows" else rows

    def _rows_of_this_worker(self, rows: Iterator[dict]) -> Iterator[dict[str, torch.Tensor]]:
        workers, worker = _loader_worker()
        per_micro_batch = self.dp_world_size * self.local_batch_size
        for row in rows:
            index = self.rows_seen
            self.rows_seen += 1  # before yielding: the state always means "consumed"
            in_batch = index % per_micro_batch
            if in_batch // self.local_batch_size != self.dp_rank:
                continue
            if (index // per_micro_batch) % workers != worker:
                continue
            if in_batch % self.local_batch_size == self.local_batch_size - 1:
                # This rank's last row of the micro-batch: pack the other ranks' rows first, so
                # the state at every batch boundary is the end of a global micro-batch, the same
                # on every rank (a checkpoint then resumes at any dp degree).
                while self.rows_seen % per_micro_batch:
                    next(rows)
                    self.rows_seen += 1
            yield row

    def _greedy(self) -> Iterator[dict[str, torch.Tensor]]:
        window = self.seq_len + 1
        docs = iter(self.source)
        if self.reread_pos is not None:  # a loaded state: read its current document again
            self.before_current = self.source.state_dict()
            self.current, self.current_pos = next(docs) + [self.eos_id], self.reread_pos
            self.reread_pos = None
        while True:
            while len(self.buffer) < window:
                if self.current_pos >= len(self.current):  # >=: a loaded position past its end
                    self.before_current = self.source.state_dict()
                    self.current, self.current_pos = next(docs) + [self.eos_id], 0
                    self.docs_seen += 1
                take = self.current[self.current_pos : self.current_pos + window - len(self.buffer)]
                self.current_pos += len(take)
                self.buffer += take
                _add_run(self.buffer_runs, self.docs_seen - 1, len(take))
            tokens = torch.tensor(self.buffer[:window])
            doc_ids = _run_ids(self.buffer_runs, self.seq_len)
            # Keep the window's last token: it is the first input of the next row.
            self.buffer = self.buffer[self.seq_len :]
            _drop_runs(self.buffer_runs, self.seq_len)
            yield {
                "input_ids": tokens[:-1],
                "labels": tokens[1:],
                "positions": segment_positions(doc_ids),
                "document_ids": doc_ids,
            }

    def _padding(self) -> Iterator[dict[str, torch.Tensor]]:
        window = self.seq_len + 1
        for doc in self.source:
            row = (doc + [self.eos_id])[:window]
            n = len(row)  # real tokens; inputs 0..n-2 have real labels
            tokens = torch.full((window,), self.pad_id, dtype=torch.long)
            tokens[:n] = torch.tensor(row)
            labels = tokens[1:].clone()
            labels[n - 1 :] = IGNORE_INDEX  # by length, not value: pad_id may equal eos_id
            doc_ids = torch.zeros(self.seq_len, dtype=torch.long)
            doc_ids[n:] = 1  # inputs n.. are padding; input n-1 is the last real token
            yield {
                "input_ids": tokens[:-1],
                "labels": labels,
                "positions": segment_positions(doc_ids),
                "document_ids": doc_ids,
            }

    def state_dict(self) -> dict[str, Any]:
        if self.reread_pos is not None:  # loaded, not iterated yet: the loaded state as it was
            source, current_pos = self.source.state_dict(), self.reread_pos
        elif self.current_pos < len(self.current):
            # Mid-document: the source as it was before that document, which a resume reads
            # again from `current_pos` on.
            source, current_pos = self.before_current, self.current_pos
        else:
            source, current_pos = self.source.state_dict(), None
        return {
            "source": source,
            "current_pos": current_pos,
            "buffer": list(self.buffer),
            "buffer_runs": [list(r) for r in self.buffer_runs],
            "docs_seen": self.docs_seen,
            "rows_seen": self.rows_seen,
            "sharding": self.sharding,
            "dp": [self.dp_rank, self.dp_world_size],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        per_micro_batch = self.dp_world_size * self.local_batch_size
        if self.sharding != "rows" or state.get("sharding") != "rows":
            warn_if_dp_changed(state["dp"], self.dp_rank, self.dp_world_size)
        elif state["rows_seen"] % per_micro_batch:
            warnings.warn(
                f"data loader state at global row {state['rows_seen']} is not a batch boundary "
                f"of dp {self.dp_world_size} x batch {self.local_batch_size}: the data order "
                "will not resume exactly (keep training.global_batch_size when changing layout)",
                stacklevel=2,
            )
        self.source.load_state_dict(state["source"])
        self.buffer = list(state["buffer"])
        if "buffer_runs" in state:
            self.buffer_runs = [list(r) for r in state["buffer_runs"]]
        else:  # a state that kept one document number per buffered token
            self.buffer_runs = []
            for doc in state["buffer_docs"]:
                _add_run(self.buffer_runs, doc, 1)
        self.current, self.current_pos = [], 0
        self.reread_pos = state.get("current_pos")
        self.docs_seen = state["docs_seen"]
        self.rows_seen = state.get("rows_seen", 0)  # absent in checkpoints before it existed


def _add_run(runs: list[list[int]], doc: int, count: int) -> None:
    if runs and runs[-1][0] == doc:
        runs[-1][1] += count
    elif count:
        runs.append([doc, count])


def _drop_runs(runs: list[list[int]], count: int) -> None:
    """Removes the first `count` tokens from the runs."""
    while count and runs:
        take = min(count, runs[0][1])
        runs[0][1] -= take
        count -= take
        if not runs[0][1]:
            runs.pop(0)


def _run_ids(runs: list[list[int]], length: int) -> torch.Tensor:
    """Segment ids 0, 1, ... of the first `length` tokens of the runs."""
    counts = torch.tensor([c for _, c in runs])
    return torch.repeat_interleave(torch.arange(len(runs)), counts)[:length]


def shard_for_this_worker(
    source: SyntheticDocuments | TextDocuments, dp_rank: int, dp_world_size: int
) -> None:
    """Loader workers split this rank's documents further: shard = (dp rank, worker)."""
    workers, worker = _loader_worker()
    source.set_shard(dp_rank * workers + worker, dp_world_size * workers)


def _loader_worker() -> tuple[int, int]:
    """(number of loader workers, this one's index); (1, 0) in the main process."""
    info = get_worker_info()
    return (info.num_workers, info.id) if info else (1, 0)


def state_same_on_every_rank(sharding: str, num_workers: int) -> bool:
    """Whether every rank's loader state is the same at a step boundary, so that one rank's
    resumes the data at any world size: rows sharding ends each batch at the end of a global
    micro-batch, and with more than one worker each worker holds a state of its own."""
    return sharding == "rows" and num_workers <= 1


def warn_if_dp_changed(saved_dp: list[int], dp_rank: int, dp_world_size: int) -> None:
    """Loader states are per data-parallel rank: another layout cannot resume them exactly."""
    if list(saved_dp) != [dp_rank, dp_world_size]:
        warnings.warn(
            f"data loader state saved as dp rank/world {list(saved_dp)} is loaded as "
            f"{[dp_rank, dp_world_size]}: the data order will not resume exactly",
            stacklevel=3,
        )
