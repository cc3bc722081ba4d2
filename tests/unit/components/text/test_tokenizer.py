"""Tokenizers: round trips for every format, special ids, directory lookup, clear errors."""

import json
from pathlib import Path

import pytest

from tests.helpers.hf_tokenizer import TEXTS, make_hf_tokenizer_json
from torchtitan_ablate.components.text.tokenizer import (
    Tokenizer,
    build_tokenizer,
    hf_tokenizer_json_to_ranks,
    load_tiktoken_ranks,
    save_tiktoken_ranks,
)
from torchtitan_ablate.config import ConfigError

ROOT = Path(__file__).resolve().parents[4]
DEBUG_TIKTOKEN = ROOT / "assets" / "tokenizer" / "debug.tiktoken"


def check_round_trip(tok: Tokenizer, texts: list[str] = TEXTS) -> None:
    assert isinstance(tok, Tokenizer)
    for text in texts:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    for special in (tok.eos_id, tok.pad_id, tok.bos_id):
        assert special is None or 0 <= special < tok.vocab_size


def test_byte_tokenizer() -> None:
    tok = build_tokenizer("byte")
    check_round_trip(tok)
    assert (tok.vocab_size, tok.eos_id, tok.bos_id, tok.pad_id) == (259, 256, 257, 258)
    assert tok.encode("ab") == [97, 98]
    assert tok.decode([97, tok.eos_id, 98]) == "ab"


def test_shipped_debug_tiktoken() -> None:
    tok = build_tokenizer(str(DEBUG_TIKTOKEN))
    check_round_trip(tok)
    assert tok.vocab_size == 2000 <= 2048  # fits the debug model's vocab
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (1997, 1997, None)
    assert len(tok.encode("Alice lives in Paris and works as a baker.")) < 15  # merges work
    # Special-token text inside a document stays plain text.
    assert tok.eos_id not in tok.encode("a <|endoftext|> b")


def test_tiktoken_ranks_save_load_and_directory(tmp_path: Path) -> None:
    ranks = {bytes([b]): b for b in range(256)} | {b"ab": 256, b" c": 257}
    save_tiktoken_ranks(ranks, tmp_path / "tiny.tiktoken")
    assert load_tiktoken_ranks(tmp_path / "tiny.tiktoken") == ranks
    tok = build_tokenizer(str(tmp_path))  # a directory with one *.tiktoken
    check_round_trip(tok)
    assert tok.encode("ab c") == [256, 257]
    assert tok.vocab_size == 261 and tok.eos_id == 258  # <|endoftext|> right after the ranks
    assert tok.decode([tok.eos_id]) == "<|endoftext|>"


def test_hf_tokenizer_json_matches_hf(tmp_path: Path) -> None:
    hf = make_hf_tokenizer_json(tmp_path / "tokenizer.json")
    tok = build_tokenizer(str(tmp_path))  # directory lookup finds tokenizer.json
    check_round_trip(tok)
    assert tok.eos_id == hf.token_to_id("<|endoftext|>")
    assert tok.vocab_size == hf.get_vocab_size()
    for text in [*TEXTS, "the lazy dog sleeps, and the fox? 42 foxes!"]:
        assert tok.encode(text) == hf.encode(text).ids


def test_sentencepiece(tmp_path: Path) -> None:
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    words = "the quick brown fox jumps over lazy dog hello world sun moon star river".split()
    lines = [" ".join(words[i % 7 : i % 7 + 6]) + f" {i}" for i in range(300)]
    corpus.write_text("\n".join(lines), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "tokenizer"),
        vocab_size=320,  # 256 byte-fallback pieces + a few merges
        hard_vocab_limit=False,
        byte_fallback=True,
        minloglevel=2,
    )
    tok = build_tokenizer(str(tmp_path / "tokenizer.model"))
    check_round_trip(tok, ["the quick brown fox 42", "hello moon"])
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (2, 1, 2)  # no pad piece: pad = eos
    assert build_tokenizer(str(tmp_path)).vocab_size == tok.vocab_size  # directory lookup


@pytest.mark.parametrize(
    "name,content,match",
    [
        ("missing.tiktoken", None, "no such file or folder"),
        ("bad.tiktoken", "not base64 at all\n", r"bad.tiktoken:1"),
        ("empty.tiktoken", "", r"empty.tiktoken holds no token \(an empty file\)"),
        ("blank.tiktoken", "\n\n", r"blank.tiktoken holds no token \(an empty file\)"),
        ("tokenizer.json", "{not json", "tokenizer.json is not valid JSON"),
        ("tokenizer.json", "[1, 2]", "holds one JSON object, not a list"),
        ("tokenizer.json", '{"model": {"type": "WordPiece"}}', "only byte-level BPE"),
        ("corpus.jsonl", '{"text": "a"}\n', r"unknown tokenizer format \(corpus.jsonl\)"),
        ("tokenizer.model", "garbage", "cannot read it as a tokenizer"),
    ],
)
def test_errors_name_the_key_and_path(
    tmp_path: Path, name: str, content: str | None, match: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=match) as err:
        build_tokenizer(str(path))
    msg = str(err.value)
    assert msg.startswith(f"model.tokenizer_path = {str(path)!r}: ") and "accepted:" in msg
    assert "\n" not in msg


def test_error_for_directory_without_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "notes.json").write_text(json.dumps({}))
    with pytest.raises(ConfigError, match="model.tokenizer_path = .*: the folder holds no tokeni"):
        build_tokenizer(str(tmp_path))


@pytest.mark.parametrize(
    "data,match",
    [
        ([1, 2], "not a list"),
        ({"model": {"type": "BPE"}, "decoder": {"type": "ByteLevel"}}, 'no "vocab"'),
        ({"model": "BPE"}, "only byte-level BPE"),
    ],
)
def test_tokenizer_json_conversion_rejects_other_shapes(data: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        hf_tokenizer_json_to_ranks(data)
