"""Data sources beyond one .jsonl/.txt path: the text field, parquet, the shuffle buffer and
weighted mixtures; each resumes exactly under both data_sharding modes."""

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.data import (
    BYTE,
    DOCS,
    assert_same_rows,
    damage_row_group,
    documents_in,
    loader,
    rows,
    take,
    write_jsonl,
)
from torchtitan_ablate.components.data import dataloader
from torchtitan_ablate.components.data.datasets import TextDocuments
from torchtitan_ablate.config import ConfigError, load_config

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def write_parquet(path: Path, texts: list, column: str = "text", group: int = 5) -> Path:
    """Small row groups, so reads and resumes cross row-group boundaries."""
    pq.write_table(pa.table({column: texts, "id": list(range(len(texts)))}), path, group)
    return path


def mixture(paths: list[Path], **kw):
    return loader(None, dataset_path=[str(p) for p in paths], **kw)


def padded_docs(dl, n: int) -> list[str]:
    return documents_in(rows(dl, n), "padding")


def test_text_field_names_the_jsonl_key(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"body": t, "text": "no"}) + "\n" for t in DOCS))
    got = padded_docs(loader(path, packing="padding", dataset_text_field="body"), len(DOCS))
    assert got == DOCS
    with pytest.raises(ConfigError, match=r'd.jsonl:1: JSONL line has no string "content"'):
        loader(path, dataset_text_field="content")  # checked up front, before any batch


def test_parquet_reads_rows_in_order_by_row_group(tmp_path: Path) -> None:
    texts = DOCS[:6] + [None] + DOCS[6:]  # a null row is an empty document: skipped
    path = write_parquet(tmp_path / "d.parquet", texts, column="content")
    assert padded_docs(loader(path, packing="padding", dataset_text_field="content"), 12) == DOCS
    jsonl = write_jsonl(tmp_path / "d.jsonl", DOCS)  # greedy packing: same rows as the jsonl
    want = rows(loader(jsonl), 8)
    assert_same_rows(want, rows(loader(path, dataset_text_field="content"), 8))
    write_parquet(path, texts)
    # A folder mixes formats in sorted path order (d.jsonl, then d.parquet).
    assert padded_docs(loader(tmp_path, packing="padding"), 14)[-2:] == DOCS[:2]


def test_parquet_errors_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_parquet(tmp_path / "d.parquet", DOCS)
    with pytest.raises(ConfigError, match=r"d.parquet has no column 'body' \(columns: "):
        loader(path, dataset_text_field="body")
    with pytest.raises(ConfigError, match=r"column 'id' is int64, not a string column"):
        loader(path, dataset_text_field="id")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match=r"bad.parquet: not a readable parquet file"):
        loader(tmp_path / "bad.parquet")
    for name in ("pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"d.parquet is a parquet file .*pip install pyarrow"):
        loader(path)


def test_a_damaged_row_group_is_one_line_naming_file_and_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_parquet(tmp_path / "d.parquet", DOCS)  # row groups of 5 rows
    damage_row_group(path, 1)
    error = r"d.parquet: row group 1 \(rows 5-9\) cannot be read \(.*\): the file is damaged"
    with pytest.raises(ConfigError, match=error):  # checked before training
        loader(path)
    source = TextDocuments([path], BYTE)
    assert source.check_lines(max_bytes=1) is False  # past the budget: checked when read
    monkeypatch.setattr(dataloader, "_check_up_front", lambda source: None)
    for workers in (0, 1):  # read in the main process, or a worker's error passed back
        with pytest.raises(ConfigError, match=error) as e:
            rows(loader(path, num_workers=workers), 10)
        assert "\n" not in str(e.value) and str(e.value).startswith("training.dataset_path: ")


def test_shuffle_buffer_is_seeded_and_keeps_every_document(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    n = 5 * len(DOCS)

    def order(seed: int) -> list[str]:
        return padded_docs(loader(path, packing="padding", shuffle_buffer=4, seed=seed), n)

    assert order(0) == order(0) and order(0) != order(1)
    assert order(0)[: len(DOCS)] != DOCS
    counts = Counter(order(0))  # a buffer of 4 holds documents back by a few places only
    assert set(counts) == set(DOCS) and min(counts.values()) >= 3


def test_mixture_draws_by_weight_and_by_seed(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [f"a{i}" for i in range(7)])
    b = write_parquet(tmp_path / "b.parquet", [f"b{i}" for i in range(3)])

    def docs(weights: list[float], seed: int = 0) -> list[str]:
        dl = mixture([a, b], packing="padding", dataset_weights=weights, seed=seed)
        return padded_docs(dl, 400)

    mixed = docs([0.7, 0.3])
    share = sum(d.startswith("a") for d in mixed) / len(mixed)
    assert 0.62 < share < 0.78, share
    assert [d for d in mixed if d.startswith("b")][:4] == ["b0", "b1", "b2", "b0"]  # in order
    assert docs([7, 3]) == mixed and docs([0.7, 0.3], seed=1) != mixed
    assert 0.4 < sum(d.startswith("a") for d in docs([])) / 400 < 0.6  # empty: equal weights


CASES = [  # (shuffle_buffer, mixture, packing, num_workers, sharding)
    (4, False, "greedy", 0, "documents"),
    (4, False, "padding", 1, "documents"),
    (4, False, "greedy", 0, "rows"),
    (0, True, "greedy", 0, "documents"),
    (0, True, "padding", 0, "rows"),
    (3, True, "greedy", 1, "documents"),
    (3, True, "greedy", 0, "rows"),
]


@pytest.mark.parametrize("shuffle,mix,packing,num_workers,sharding", CASES)
def test_exact_resume(
    tmp_path: Path, shuffle: int, mix: bool, packing: str, num_workers: int, sharding: str
) -> None:
    # As test_data.py's test_exact_resume: save after 2 batches (mid-file, buffer full), then
    # a fresh loader loaded with that state gives the next 5 batches of the uninterrupted one.
    a = write_jsonl(tmp_path / "a.jsonl", DOCS)
    b = write_parquet(tmp_path / "b.parquet", [f"b{i}:" + "y" * i for i in range(9)], group=2)
    kw: dict = dict(dataset_path=[str(a), str(b)] if mix else str(b))
    kw |= dict(packing=packing, num_workers=num_workers, dp_rank=1, dp_world_size=2)
    kw |= dict(data_sharding=sharding, shuffle_buffer=shuffle, seed=3)
    kw |= dict(dataset_weights=[0.6, 0.4]) if mix else {}
    first = loader(None, **kw)
    it = iter(first)
    take(it, 2)
    state = first.state_dict()
    expected = take(it, 5)
    resumed = loader(None, **kw)
    resumed.load_state_dict(state)
    assert_same_rows(expected, take(iter(resumed), 5))


def test_rows_sharding_keeps_global_batches_with_shuffle_and_mixture(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", DOCS)
    b = write_parquet(tmp_path / "b.parquet", [f"b{i}" for i in range(5)])
    kw = dict(dataset_weights=[1.0, 2.0], shuffle_buffer=3, data_sharding="rows")
    one = rows(mixture([a, b], local_batch_size=4, **kw), 4 * 3)
    per_rank = [rows(mixture([a, b], dp_rank=r, dp_world_size=2, **kw), 2 * 3) for r in (0, 1)]
    got = [row for step in range(3) for r in (0, 1) for row in per_rank[r][2 * step : 2 * step + 2]]
    assert_same_rows(one, got)


@pytest.mark.parametrize(
    "args,error",
    [
        (["--training.dataset_weights", "1,2"], r"dataset_weights = \[1.0, 2.0\]: weights mix"),
        (["--training.shuffle_buffer", "-1"], r"training.shuffle_buffer = -1: must be >= 0"),
        (["--training.dataset_text_field", ""], r"dataset_text_field must not be empty"),
    ],
)
def test_config_rules(args: list[str], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        load_config(args)


def test_toml_mixture_is_type_checked(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    head = '[training]\ndataset_path = ["a.jsonl", "b.parquet"]\n'
    toml.write_text(head + "dataset_weights = [0.7, 0.3]\n")
    t = load_config(["--job.config_file", str(toml)]).training
    assert t.dataset_path == ["a.jsonl", "b.parquet"] and t.dataset_weights == [0.7, 0.3]
    toml.write_text(head + "dataset_weights = [0.7]\n")
    with pytest.raises(ConfigError, match=r"one weight per training.dataset_path entry \(2\)"):
        load_config(["--job.config_file", str(toml)])
    toml.write_text(head + 'dataset_weights = ["0.7", 0.3]\n')
    with pytest.raises(ConfigError, match="training.dataset_weights"):
        load_config(["--job.config_file", str(toml)])
    toml.write_text(head + "dataset_weights = [1, -1]\n")
    with pytest.raises(ConfigError, match=r"every weight must be > 0"):
        load_config(["--job.config_file", str(toml)])
    toml.write_text('[training]\ndataset = "chat"\ndataset_path = ["a.jsonl"]\n')
    with pytest.raises(ConfigError, match=r"a list \(a data mixture\) needs training.dataset"):
        load_config(["--job.config_file", str(toml)])
