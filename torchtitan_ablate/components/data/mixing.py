"""Document-stream wrappers: a weighted mixture of sources and a seeded shuffle buffer.

Both sit between the document sources (datasets.py) and packing, and keep the source contract:
set_shard, an infinite __iter__ whose state always means "consumed", state_dict/load_state_dict.
Their random draws are counter-based: draw n of shard s is a hash of (seed, s, n), so the state
is the draw counter (plus the buffer's documents) and a resumed run draws exactly what the
uninterrupted one would have. In rows sharding every rank reads shard (0, 1): the same draws
everywhere, so the global batches stay independent of the dp degree.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Iterator
from typing import Any, Protocol

from torchtitan_ablate.components.data.errors import KEY, DatasetError


class Source(Protocol):
    def set_shard(self, shard: int, num_shards: int) -> None: ...
    def __iter__(self) -> Iterator[Any]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def uniform(*key: object) -> float:
    """A number in [0, 1) that is a pure function of `key` (same on every platform)."""
    digest = hashlib.blake2b("/".join(map(str, key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


class MixedDocuments:
    """Each document comes from source i with probability weights[i] / sum(weights), drawn per
    document (as HF datasets' interleave_datasets(probabilities=...)). Every source loops over
    its own epochs, so a small source is repeated (with its warning) rather than exhausted."""

    def __init__(self, sources: list[Source], weights: list[float], seed: int) -> None:
        assert len(sources) == len(weights) and min(weights) > 0, weights  # config/rules.py
        self.sources, self.seed = sources, seed
        total = sum(weights)
        self.bounds = list(itertools.accumulate(w / total for w in weights))
        self.shard, self.num_shards = 0, 1
        self.draws = 0

    def set_shard(self, shard: int, num_shards: int) -> None:
        self.shard, self.num_shards = shard, num_shards
        for s in self.sources:
            s.set_shard(shard, num_shards)

    def __iter__(self) -> Iterator[Any]:
        streams = [iter(s) for s in self.sources]  # lazy: each resumes from its own state
        while True:
            u = uniform("mix", self.seed, self.shard, self.num_shards, self.draws)
            i = min(bisect.bisect_right(self.bounds, u), len(streams) - 1)
            doc = next(streams[i])
            self.draws += 1  # after the source moved: the state always means "consumed"
            yield doc

    def state_dict(self) -> dict[str, Any]:
        return {"draws": self.draws, "sources": [s.state_dict() for s in self.sources]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["sources"]) != len(self.sources):
            raise DatasetError(
                f"{KEY}: the checkpoint's data mixture has {len(state['sources'])} sources, "
                f"this run's {len(self.sources)}: resume with the same list of paths"
            )
        self.draws = state["draws"]
        for s, st in zip(self.sources, state["sources"], strict=True):
            s.load_state_dict(st)


class ShuffledDocuments:
    """A shuffle buffer of `size` documents (as tf.data / HF IterableDataset.shuffle): fill it,
    then for each new document yield a random one from the buffer and put the new one in its
    place. Documents move at most about `size` places further on average, so the buffer should
    span several files' worth for shuffled files. The state holds the buffer's documents (their
    tokens: size x mean document length in each checkpoint) and the draw counter.

    size 0 passes the documents through (its state is the source's). A resume with another size
    loses no document and repeats none: a saved buffer larger than `size` (0 included) yields
    its extra documents first; a smaller one is topped up from the source after its next draw."""

    def __init__(self, source: Source, size: int, seed: int) -> None:
        assert size >= 0, size
        self.source, self.size, self.seed = source, size, seed
        self.shard, self.num_shards = 0, 1
        self.buffer: list[Any] = []
        self.draws = 0

    def set_shard(self, shard: int, num_shards: int) -> None:
        self.shard, self.num_shards = shard, num_shards
        self.source.set_shard(shard, num_shards)

    def __iter__(self) -> Iterator[Any]:
        # After a resize, the first document is the one the saved buffer would have drawn next:
        # a packer that resumes mid-document reads that document again (the same one).
        docs = iter(self.source)
        while len(self.buffer) > self.size:  # a checkpoint's bigger buffer: its extra documents
            yield self.buffer.pop(self._draw(len(self.buffer)))
        if self.size == 0:
            yield from docs
            return
        out = None
        if self.buffer and len(self.buffer) < self.size:  # a checkpoint's smaller buffer
            j = self._draw(len(self.buffer))
            out, self.buffer[j] = self.buffer[j], next(docs)
        while len(self.buffer) < self.size:  # no yield in between: no state is taken here
            self.buffer.append(next(docs))
        if out is not None:
            yield out
        for doc in docs:
            j = self._draw(self.size)
            out, self.buffer[j] = self.buffer[j], doc
            yield out

    def _draw(self, size: int) -> int:
        """The buffer index of the next draw from `size` documents."""
        u = uniform("shuffle", self.seed, self.shard, self.num_shards, self.draws)
        self.draws += 1
        return int(u * size)

    def state_dict(self) -> dict[str, Any]:
        if self.size == 0 and not self.buffer:  # as without a buffer: either size resumes it
            return self.source.state_dict()
        return {
            "source": self.source.state_dict(),
            "buffer": list(self.buffer),
            "draws": self.draws,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "buffer" not in state:  # saved with shuffling off: start an empty buffer from there
            self.source.load_state_dict(state)
            self.buffer, self.draws = [], 0
            return
        self.source.load_state_dict(state["source"])
        self.buffer, self.draws = list(state["buffer"]), state["draws"]
