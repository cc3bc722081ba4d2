"""Data pipeline: packing layout, dp sharding, exact resume, text formats, clear errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.data import (
    BYTE,
    DOCS,
    EOS,
    PAD,
    assert_same_rows,
    documents_in,
    loader,
    rows,
    take,
    write_jsonl,
)
from torchtitan_ablate.components.text.tokenizer import build_tokenizer
from torchtitan_ablate.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[4]


def test_greedy_packing_layout(tmp_path: Path) -> None:
    dl = loader(write_jsonl(tmp_path / "d.jsonl", DOCS))
    stream, doc_of = [], []  # the token stream d0 EOS d1 EOS ..., twice (epochs re-loop)
    for d, text in enumerate(DOCS * 2):
        stream += list(text.encode()) + [EOS]
        doc_of += [d] * (len(text) + 1)
    for r, row in enumerate(rows(dl, 10)):
        start = r * 16  # windows of 17 tokens overlapping by one
        assert row["input_ids"].tolist() == stream[start : start + 16]
        assert row["labels"].tolist() == stream[start + 1 : start + 17]
        docs = torch.tensor(doc_of[start : start + 16])
        assert row["document_ids"].tolist() == (docs - docs[0]).tolist()
        for i in range(16):  # positions restart at each segment start and at the row start
            seg_start = next(j for j in range(i + 1) if docs[j] == docs[i])
            assert row["positions"][i] == i - seg_start
    batch = next(iter(dl))
    assert all(v.dtype == torch.long and v.shape == (2, 16) for v in batch.values())


def test_padding_packing_layout(tmp_path: Path) -> None:
    texts = ["abc", "z" * 40]
    dl = loader(write_jsonl(tmp_path / "d.jsonl", texts), packing="padding")
    short, long = rows(dl, 2)
    assert short["input_ids"].tolist() == [97, 98, 99, EOS] + [PAD] * 12
    assert short["labels"].tolist() == [98, 99, EOS] + [-100] * 13
    assert short["document_ids"].tolist() == [0] * 4 + [1] * 12
    assert short["positions"].tolist() == list(range(4)) + list(range(12))
    # Too long: truncated to seq_len + 1 tokens, no EOS, nothing ignored.
    assert long["input_ids"].tolist() == [122] * 16 and long["labels"].tolist() == [122] * 16
    assert long["document_ids"].tolist() == [0] * 16
    assert long["positions"].tolist() == list(range(16))


def test_txt_paragraphs_and_folders(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("first para\nline two\n\n\n\nsecond\n")
    write_jsonl(tmp_path / "b" / "c.jsonl", ["third"])
    (tmp_path / "ignored.md").write_text("not data")
    dl = loader(tmp_path, packing="padding")
    got = [BYTE.decode(r["input_ids"].tolist()) for r in rows(dl, 4)]
    assert got == ["first para\nline ", "second", "third", "first para\nline "]


@pytest.mark.parametrize("packing", ["greedy", "padding"])
def test_dp_shards_are_disjoint_and_cover(tmp_path: Path, packing: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    seen = []
    for rank in range(3):
        dl = loader(path, packing=packing, dp_rank=rank, dp_world_size=3, seq_len=32)
        seen.append(set(documents_in(rows(dl, 6), packing)))
        assert seen[-1] == {d for i, d in enumerate(DOCS) if i % 3 == rank}
    assert set().union(*seen) == set(DOCS)


@pytest.mark.parametrize("packing,num_workers", [("greedy", 0), ("padding", 0), ("greedy", 2)])
def test_rows_sharding_gives_the_same_global_batches(
    tmp_path: Path, packing: str, num_workers: int
) -> None:
    # dp 3 x batch 2 in rows mode: each step's six rows are the 1-rank batch of six, in order.
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    one = rows(loader(path, packing=packing, local_batch_size=6), 6 * 4)
    per_rank = [
        rows(
            loader(
                path,
                packing=packing,
                local_batch_size=2,
                dp_rank=rank,
                dp_world_size=3,
                data_sharding="rows",
                num_workers=num_workers,
            ),
            2 * 4,
        )
        for rank in range(3)
    ]
    for step in range(4):
        got = [row for rank in range(3) for row in per_rank[rank][2 * step : 2 * step + 2]]
        assert_same_rows(one[6 * step : 6 * step + 6], got)


@pytest.mark.parametrize("packing", ["greedy", "padding"])
def test_rows_sharding_state_resumes_at_another_dp(tmp_path: Path, packing: str) -> None:
    # Save after 2 batches at dp 3 x batch 2, resume rank 0's state at dp 2 x batch 3: the
    # next global batches are the 1-rank stream's rows 12.. in order.
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    ref = rows(loader(path, packing=packing, local_batch_size=6), 6 * 4)
    kw = dict(packing=packing, data_sharding="rows")
    states = []
    for rank in range(3):
        dl = loader(path, local_batch_size=2, dp_rank=rank, dp_world_size=3, **kw)
        take(iter(dl), 2)
        states.append(dl.state_dict())
    for st in states:  # the same on every rank at a batch boundary, but for the rank itself
        assert st["dataset_state"].pop("dp")[1] == 3
    assert all(st == states[0] for st in states[1:])
    states[0]["dataset_state"]["dp"] = [0, 3]
    resumed = []
    for rank in range(2):
        dl = loader(path, local_batch_size=3, dp_rank=rank, dp_world_size=2, **kw)
        dl.load_state_dict(states[0])
        resumed.append(rows(dl, 3 * 2))
    for step in range(2):
        got = [row for rank in range(2) for row in resumed[rank][3 * step : 3 * step + 3]]
        assert_same_rows(ref[12 + 6 * step : 18 + 6 * step], got)


def test_synthetic_is_deterministic_and_rank_dependent() -> None:
    a = rows(loader(None, "synthetic", seed=3), 4)
    b = rows(loader(None, "synthetic", seed=3), 4)
    c = rows(loader(None, "synthetic", seed=3, dp_rank=1, dp_world_size=2), 4)
    d = rows(loader(None, "synthetic", seed=4), 4)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    assert not torch.equal(a[0]["input_ids"], c[0]["input_ids"])
    assert not torch.equal(a[0]["input_ids"], d[0]["input_ids"])
    assert all(int(r["input_ids"].max()) < BYTE.vocab_size for r in a)


def test_synthetic_doc_len_seq_len_fills_each_row_with_one_document() -> None:
    # Long-sequence throughput studies need the same attention work in every step.
    for row in rows(loader(None, "synthetic", synthetic_doc_len=16), 6):
        assert torch.equal(row["document_ids"], torch.zeros(16, dtype=torch.long))
        assert torch.equal(row["positions"], torch.arange(16))
        assert int(row["input_ids"][-1]) == EOS and EOS not in row["input_ids"][:-1].tolist()
    # Shorter documents: each doc_len tokens, its EOS the last.
    ids = torch.cat(
        [r["input_ids"] for r in rows(loader(None, "synthetic", synthetic_doc_len=4), 4)]
    )
    assert (ids == EOS).nonzero().flatten().tolist() == list(range(3, 64, 4))


@pytest.mark.parametrize(
    "dataset,packing,num_workers,sharding",
    [
        ("text", "greedy", 0, "documents"),
        ("text", "padding", 0, "documents"),
        ("synthetic", "greedy", 0, "documents"),
        ("text", "greedy", 1, "documents"),
        ("text", "greedy", 0, "rows"),
        ("synthetic", "padding", 2, "rows"),
    ],
)
def test_exact_resume(
    tmp_path: Path, dataset: str, packing: str, num_workers: int, sharding: str
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)  # 7 batches span 2 epochs
    kw = dict(packing=packing, num_workers=num_workers, dp_rank=1, dp_world_size=2)
    kw["data_sharding"] = sharding
    first = loader(path, dataset, **kw)
    it = iter(first)
    take(it, 2)  # saved mid-file in the second epoch
    state = first.state_dict()
    expected = take(it, 5)
    resumed = loader(path, dataset, **kw)
    resumed.load_state_dict(state)
    assert_same_rows(expected, take(iter(resumed), 5))


def test_debug_assets_load() -> None:
    tok = build_tokenizer(str(ROOT / "assets" / "tokenizer" / "debug.tiktoken"))
    dl = loader(ROOT / "assets" / "data", tokenizer=tok, seq_len=256, local_batch_size=8)
    batch = next(iter(dl))
    assert batch["input_ids"].shape == (8, 256) and int(batch["input_ids"].max()) < 2048
    assert (batch["input_ids"] == tok.eos_id).any()


def _bad_input(tmp_path: Path, case: str) -> tuple[str | None, dict]:
    """(training.dataset_path, other build_dataloader arguments) of one user mistake."""
    bad = tmp_path / "bad.jsonl"
    if case == "missing":
        return str(tmp_path / "nope.jsonl"), {}
    if case == "not_set":
        return None, {}
    if case == "empty_jsonl":
        bad.write_text("")
        return str(bad), {}
    if case == "empty_folder":
        return str(tmp_path), {}
    if case == "csv":
        (tmp_path / "d.csv").write_text("text\nhello\n")
        return str(tmp_path / "d.csv"), {}
    if case == "blank_txt":
        (tmp_path / "d.txt").write_text("\n  \n\n")
        return str(tmp_path / "d.txt"), {}
    if case == "malformed_line_2":
        bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    elif case == "text_not_a_string":
        bad.write_text('{"text": "ok"}\n\n{"text": 5}\n')
    elif case == "not_utf8":
        bad.write_bytes(b'{"text": "\xff"}\n')
    elif case == "chat_line_as_text":
        bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    elif case == "shard_without_documents":
        write_jsonl(bad, ["one", "two"])
        return str(bad), {"dp_rank": 2, "dp_world_size": 3}
    elif case == "chat_on_text_corpus":
        return str(ROOT / "assets" / "data" / "debug_corpus.jsonl"), {"dataset": "chat"}
    elif case == "chat_on_txt_file":
        (tmp_path / "d.txt").write_text("hello\n")
        return str(tmp_path / "d.txt"), {"dataset": "chat"}
    return str(bad), {"packing": "padding"}


BAD_INPUTS = {
    "missing": r"training.dataset_path = '.*nope.jsonl': no such file or folder",
    "not_set": r"training.dataset_path is not set: training.dataset = 'text' needs",
    "empty_jsonl": r"training.dataset_path: .*bad.jsonl holds no documents",
    "empty_folder": r"training.dataset_path = '.*': the folder holds no .txt/.jsonl/.parquet files",
    "csv": r"training.dataset_path = '.*d.csv': not a .txt/.jsonl/.parquet file",
    "blank_txt": r"training.dataset_path: .*d.txt holds no documents",
    "malformed_line_2": r"training.dataset_path: .*bad.jsonl:2: invalid JSON",
    "text_not_a_string": r"training.dataset_path: .*bad.jsonl:3: JSONL line has no string \"text\"",
    "not_utf8": r"training.dataset_path: .*bad.jsonl:1: not valid UTF-8",
    "chat_line_as_text": r"bad.jsonl:1: .*use training.dataset = 'chat'",
    "shard_without_documents": r"training.dataset_path: .*shard 2 of 3 .* got no non-empty doc",
    "chat_on_text_corpus": r"training.dataset_path: .*debug_corpus.jsonl:1: expected \{\"messa",
    "chat_on_txt_file": r"training.dataset_path: training.dataset = 'chat' reads .jsonl files only",
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_data_is_a_one_line_config_error(tmp_path: Path, case: str) -> None:
    path, kw = _bad_input(tmp_path, case)
    if kw.get("dataset") == "chat":
        kw["tokenizer"] = build_tokenizer(str(ROOT / "assets" / "tokenizer" / "debug.tiktoken"))
    with pytest.raises(ConfigError, match=BAD_INPUTS[case]) as err:
        next(iter(loader(path, **kw)))  # some errors only show once the data is read
    assert "\n" not in str(err.value)


def test_worker_error_reaches_the_main_process_as_one_line(tmp_path: Path) -> None:
    path, _ = _bad_input(tmp_path, "malformed_line_2")
    with pytest.raises(ConfigError) as err:
        next(iter(loader(path, packing="padding", num_workers=1)))
    assert str(err.value).startswith("training.dataset_path: ") and "\n" not in str(err.value)
    assert str(err.value).endswith("each line must be one JSON object")


def test_bad_config_values_are_rejected_by_the_loader_of_the_config() -> None:
    with pytest.raises(ConfigError, match="training.dataset = 'hf'"):
        load_config(["--training.dataset", "hf"])
    with pytest.raises(ConfigError, match="training.packing = 'best'"):
        load_config(["--training.packing", "best"])
    with pytest.raises(ConfigError, match="training.data_sharding = 'rows' is for text and synth"):
        load_config(["--training.dataset", "chat", "--training.data_sharding", "rows"])


def test_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = write_jsonl(tmp_path / "bad.jsonl", ["one"])

    def deny(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("builtins.open", deny)  # root ignores chmod, so simulate it
    with pytest.raises(ConfigError, match=rf"training.dataset_path: cannot read {bad}: Permission"):
        loader(bad)


def test_trainer_exits_2_with_one_line_for_a_missing_dataset(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torchtitan_ablate.train"]
    cmd += ["--job.config_file", "train_configs/debug_model.toml", "--training.steps", "2"]
    cmd += ["--job.dump_folder", str(tmp_path), "--training.dataset_path", "/nonexistent/x.jsonl"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "config error: training.dataset_path = '/nonexistent/x.jsonl': no such file or folder"
    ]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_long_document_stays_out_of_the_loader_state(tmp_path: Path, num_workers: int) -> None:
    # A document of ~60 windows between short ones: its tokens are drawn a window at a time, so
    # the state a worker sends with every batch stays small, and a resume in its middle reads it
    # again and continues exactly.
    long_doc = "".join(chr(97 + i % 26) for i in range(1000))
    path = write_jsonl(tmp_path / "d.jsonl", DOCS[:2] + [long_doc] + DOCS[2:])
    kw = dict(num_workers=num_workers, data_sharding="rows")
    first = loader(path, **kw)
    it = iter(first)
    take(it, 6)  # rows 0-11: well inside the long document
    state = first.state_dict()
    assert len(repr(state)) < 3000, len(repr(state))
    expected = take(it, 40)  # through the end of the long document and beyond
    resumed = loader(path, **kw)
    resumed.load_state_dict(state)
    assert_same_rows(expected, take(iter(resumed), 40))
    # The same rows as a run that never stopped, from the start.
    assert_same_rows(rows(loader(path, **kw), 92)[12:], rows(expected, 80))


def test_a_state_with_one_document_number_per_token_still_resumes(tmp_path: Path) -> None:
    # Checkpoints of earlier versions kept the whole carried-over buffer with a document number
    # per token ("buffer_docs"); they resume to the same rows.
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    first = loader(path)
    it = iter(first)
    take(it, 2)
    state = first.state_dict()
    expected = take(it, 3)
    dataset = state["dataset_state"]
    buffer, doc_of = dataset.pop("buffer"), dataset.pop("buffer_runs")
    doc_of = [doc for doc, count in doc_of for _ in range(count)]
    pos = dataset.pop("current_pos")
    if pos is not None:  # the old buffer held the rest of the document being drawn from
        source = loader(path).dataset.source
        source.load_state_dict(dataset["source"])
        rest = (next(iter(source)) + [EOS])[pos:]
        buffer, doc_of = buffer + rest, doc_of + [dataset["docs_seen"] - 1] * len(rest)
        dataset["source"] = source.state_dict()
    dataset |= {"buffer": buffer, "buffer_docs": doc_of}
    resumed = loader(path)
    resumed.load_state_dict(state)
    assert_same_rows(expected, take(iter(resumed), 3))
