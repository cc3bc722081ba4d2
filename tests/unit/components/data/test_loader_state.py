"""A loader state resumed with another training.num_workers or shuffle_buffer: the data continues
exactly where the position carries over (loader_state.py), else one ConfigError line."""

import logging
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.helpers.data import (
    BYTE,
    DOCS,
    assert_same_rows,
    documents_in,
    loader,
    rows,
    take,
    write_jsonl,
)
from torchtitan_ablate.config import ConfigError


def _saved_after(n: int, **kw):
    """(the loader state after n batches, the batches after them) of a loader of `kw`."""
    first = loader(None, **kw)
    it = iter(first)
    take(it, n)
    return first.state_dict(), take(it, 4)


@pytest.mark.parametrize(
    "before,after,sharding",
    [(0, 1, "documents"), (1, 0, "documents"), (0, 2, "rows"), (2, 0, "rows"), (3, 2, "rows")],
)
@pytest.mark.parametrize("shuffle", [0, 3])
def test_another_num_workers_continues_exactly_where_the_position_carries(
    tmp_path: Path, before: int, after: int, sharding: str, shuffle: int, caplog
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", DOCS * 3)
    kw = dict(dataset_path=str(path), data_sharding=sharding, shuffle_buffer=shuffle, seed=1)
    kw |= dict(dp_rank=1, dp_world_size=2)
    state, _ = _saved_after(5, num_workers=before, **kw)
    want = _saved_after(5, num_workers=after, **kw)[1] if sharding == "rows" else None
    if sharding == "documents":  # 0 and 1 worker read the same shard: the same batches
        want = _saved_after(5, num_workers=before, **kw)[1]
    resumed = loader(None, num_workers=after, **kw)
    with caplog.at_level(logging.INFO, logger="torchtitan_ablate"):
        resumed.load_state_dict(state)
    assert f"training.num_workers {before} -> {after}: the data continues exactly" in caplog.text
    assert_same_rows(want, take(iter(resumed), 4))


@pytest.mark.parametrize("before,after", [(0, 2), (2, 0), (2, 3)])
def test_another_num_workers_with_documents_sharding_is_one_line(
    tmp_path: Path, before: int, after: int
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    state, _ = _saved_after(3, dataset_path=str(path), num_workers=before)
    resumed = loader(path, num_workers=after)
    hint = " \\(0 and 1 are interchangeable\\)" if before <= 1 else "$"
    with pytest.raises(ConfigError, match=f"resume with --training.num_workers {before}{hint}"):
        resumed.load_state_dict(state)
    with pytest.raises(ConfigError, match=f"^training.num_workers = {after}: the checkpoint's"):
        resumed.load_state_dict(state)


@pytest.mark.parametrize("before,after", [(4, 0), (4, 2), (0, 4), (2, 5)])
def test_another_shuffle_buffer_skips_and_repeats_no_document(
    tmp_path: Path, before: int, after: int, caplog
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    kw = dict(dataset_path=str(path), packing="padding", local_batch_size=1)
    first = loader(None, shuffle_buffer=before, **kw)
    seen = documents_in(rows(first, 5), "padding")
    resumed = loader(None, shuffle_buffer=after, **kw)
    with caplog.at_level(logging.INFO, logger="torchtitan_ablate"):
        resumed.load_state_dict(first.state_dict())
    assert f"training.shuffle_buffer {before} -> {after}: " in caplog.text
    rest = documents_in(rows(resumed, 2 * len(DOCS)), "padding")
    # What was read from the file is what was yielded, before and after the resume, plus what
    # the buffer holds now.
    state = resumed.state_dict()["dataset_state"]["source"]
    buffer = [BYTE.decode(d) for d in state["buffer"]] if "buffer" in state else []
    file = state.get("source", state)
    read = file["epoch"] * DOCS + DOCS[: file["doc_idx"]]
    assert Counter(seen + rest + buffer) == Counter(read)


@pytest.mark.parametrize("before,after", [(4, 0), (4, 2), (2, 5)])
def test_another_shuffle_buffer_mid_document_finishes_that_document(
    tmp_path: Path, before: int, after: int
) -> None:
    """Saved in the middle of a long document (greedy packing reads it again on resume): the
    resized buffer yields that document first, so the row continues it (it once looped forever
    on a shorter document)."""
    path = write_jsonl(tmp_path / "d.jsonl", [d * 6 for d in DOCS])  # 30-72 bytes: rows split them
    kw = dict(dataset_path=str(path), local_batch_size=1)
    state, want = _saved_after(3, shuffle_buffer=before, **kw)
    resumed = loader(None, shuffle_buffer=after, **kw)
    resumed.load_state_dict(state)
    have = take(iter(resumed), 4)
    ids = want[0]["document_ids"][0]
    end = int((ids != ids[0]).nonzero()[0]) if bool((ids != ids[0]).any()) else len(ids)
    assert torch.equal(have[0]["input_ids"][0, :end], want[0]["input_ids"][0, :end])
    later = documents_in([{"input_ids": b["input_ids"][0]} for b in have], "greedy")[1:]
    assert len(set(later)) == len(later) and set(later) <= {d * 6 for d in DOCS}
