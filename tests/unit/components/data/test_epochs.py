"""training.epochs -> steps (components/data/epochs.py): what one pass over the data holds, in
the unit a step consumes, counted against figures computed here independently."""

import json
from pathlib import Path

import pytest

from torchtitan_ablate.components.data.epochs import num_epoch_steps
from torchtitan_ablate.components.data.errors import DatasetError
from torchtitan_ablate.components.data.sft import ChatRenderer
from torchtitan_ablate.components.text.tokenizer import build_tokenizer
from torchtitan_ablate.config.job_config import Training

ROOT = Path(__file__).resolve().parents[4]
CHAT = ROOT / "assets/sft/debug_chat.jsonl"
DOCS = ["hello world", "", "a", "the quick brown fox jumps"]  # the empty one is not a document


@pytest.fixture(scope="module")
def byte_tok():
    return build_tokenizer("byte")


def _jsonl(path: Path, docs: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def _data(path, epochs: float, **kw) -> Training:
    return Training(dataset_path=path, epochs=epochs, seq_len=kw.pop("seq_len", 8), **kw)


def test_text_greedy_counts_every_token_and_eos_of_the_stream(tmp_path, byte_tok):
    path = _jsonl(tmp_path / "a.jsonl", DOCS)
    stream = sum(len(d.encode()) + 1 for d in DOCS if d)  # bytes + EOS: 12 + 2 + 26 = 40
    one = num_epoch_steps(_data(path, 1.0), byte_tok, sequences_per_step=2, num_shards=1)
    assert (one.unit, one.per_pass, one.per_step) == ("tokens", stream, 2 * 8)
    assert one.steps == 3  # ceil(40 / 16)
    assert num_epoch_steps(_data(path, 2.5), byte_tok, 2, 1).steps == 7  # ceil(100 / 16)
    assert num_epoch_steps(_data(path, 0.01), byte_tok, 2, 1).steps == 1  # at least one
    # Text is counted over all the data, not a shard's: the same whatever the shards.
    sharded = num_epoch_steps(_data(path, 1.0), byte_tok, 2, num_shards=8)
    assert (sharded.per_pass, sharded.steps) == (one.per_pass, one.steps)


def test_a_mixture_counts_all_of_its_sources(tmp_path, byte_tok):
    a = _jsonl(tmp_path / "a.jsonl", DOCS)
    b = _jsonl(tmp_path / "b.jsonl", ["xyz"] * 5)
    mixed = num_epoch_steps(_data([a, b], 1.0, dataset_weights=[0.9, 0.1]), byte_tok, 2, 1)
    assert mixed.per_pass == 40 + 5 * 4


def test_padding_counts_one_row_per_document(tmp_path, byte_tok):
    path = _jsonl(tmp_path / "a.jsonl", DOCS * 5)  # 15 documents, the longest cut to a row
    e = num_epoch_steps(_data(path, 1.0, packing="padding"), byte_tok, 4, 1)
    assert (e.unit, e.per_pass, e.per_step, e.steps) == ("rows", 15, 4, 4)


def test_no_document_is_one_error_line(tmp_path, byte_tok):
    path = _jsonl(tmp_path / "a.jsonl", ["", ""])
    with pytest.raises(DatasetError, match="no usable document"):
        num_epoch_steps(_data(path, 1.0), byte_tok, 2, 1)


def _greedy_rows(lengths: list[int], seq_len: int) -> int:
    """Rows of greedy packing of whole conversations: a new row when the next does not fit."""
    rows, room = 0, 0
    for n in lengths:
        if n > room:
            rows, room = rows + 1, seq_len
        room -= n
    return rows


@pytest.mark.parametrize("shards", [1, 3])
def test_chat_counts_the_packers_rows_of_each_shard(shards):
    """Greedy chat rows of each shard's conversations (i % shards), packed apart as the loader
    of each data-parallel rank x worker packs them; padding: one row per conversation."""
    tok = build_tokenizer(str(ROOT / "assets/tokenizer/debug.tiktoken"))
    render, seq_len = ChatRenderer(tok), 256
    lengths = []
    for line in CHAT.read_text().splitlines():
        tokens, mask = render(json.loads(line)["messages"])
        lengths.append(min(len(tokens), seq_len))
    expected = sum(_greedy_rows(lengths[s::shards], seq_len) for s in range(shards))
    data = _data(str(CHAT), 1.0, dataset="chat", seq_len=seq_len)
    greedy = num_epoch_steps(data, tok, sequences_per_step=4, num_shards=shards)
    assert (greedy.unit, greedy.per_pass, greedy.steps) == ("rows", expected, -(-expected // 4))
    assert len(lengths) > expected  # several conversations share a row
    data.packing = "best_fit"  # fills rows at least as well as greedy
    assert num_epoch_steps(data, tok, 4, shards).per_pass <= expected
    data.packing = "padding"
    assert num_epoch_steps(data, tok, 4, shards).per_pass == len(lengths)


def test_preference_pairs_skip_the_bad_rows(tmp_path, byte_tok):
    pair = {"prompt": "p", "chosen": "yes", "rejected": "no"}
    lines = [json.dumps(pair)] * 6 + ["not json"]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    data = _data(str(path), 1.0, dataset="preference", packing="padding", seq_len=32)
    e = num_epoch_steps(data, byte_tok, 4, 1, max_bad_rows=1)
    assert (e.per_pass, e.steps) == (6, 2)
    data.packing = "greedy"  # pairs of (1 + 3 + EOS) + (1 + 2 + EOS) = 9: three per row
    assert num_epoch_steps(data, byte_tok, 4, 1, max_bad_rows=1).per_pass == 2
