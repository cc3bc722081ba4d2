"""components/text/bpe.py: the incremental trainer against the plain recount-every-merge BPE,
and the exported tokenizer.json against tiktoken (a reference of the `tokenizers` library's
merge rule, and the library itself where installed)."""

import collections
import json
import random

import pytest
import regex

from torchtitan_ablate.components.text.bpe import count_pretokens, hf_tokenizer_json, train_bpe
from torchtitan_ablate.components.text.tokenizer import (
    QWEN_PATTERN,
    TIKTOKEN_SPECIALS,
    TiktokenTokenizer,
    build_tokenizer,
    bytes_to_unicode,
)


def reference_bpe(texts: list[str], num_ranks: int) -> dict[bytes, int]:
    """Every merge recounts all pairs: most frequent first, ties to the smallest pair."""
    counts = count_pretokens(texts)
    words = [[bytes([b]) for b in w.encode("utf-8")] for w in sorted(counts)]
    freqs = [counts[w] for w in sorted(counts)]
    ranks = {bytes([b]): b for b in range(256)}
    while len(ranks) < num_ranks:
        pairs = collections.Counter()
        for parts, freq in zip(words, freqs):
            for pair in zip(parts, parts[1:]):
                pairs[pair] += freq
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        ranks.setdefault(best[0] + best[1], len(ranks))
        for i, parts in enumerate(words):
            out, j = [], 0
            while j < len(parts):
                if j + 1 < len(parts) and (parts[j], parts[j + 1]) == best:
                    out.append(best[0] + best[1])
                    j += 2
                else:
                    out.append(parts[j])
                    j += 1
            words[i] = out
    return ranks


def sample_texts(seed: int, n: int = 40) -> list[str]:
    rng = random.Random(seed)
    words = ["def", "self", "return", "value", "the", "None", "café", "naïve", "x1", "  ", "\n"]
    words += ["".join(rng.choice("abcde") for _ in range(rng.randint(1, 6))) for _ in range(30)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 80))) for _ in range(n)]


@pytest.mark.parametrize("seed, num_ranks", [(0, 400), (1, 600), (2, 5000)])
def test_incremental_trainer_equals_the_recounting_one(seed, num_ranks):
    texts = sample_texts(seed)
    assert train_bpe(count_pretokens(texts), num_ranks) == reference_bpe(texts, num_ranks)


def hf_bpe_reference(text: str, data: dict) -> list[int]:
    """The tokenizers library's BPE for a byte-level model with ignore_merges: a piece found
    whole in the vocabulary is one id; else the adjacent pair listed first in merges (then the
    leftmost) is merged until none is listed."""
    vocab = data["model"]["vocab"]
    merge_rank = {tuple(m.split(" ")): i for i, m in enumerate(data["model"]["merges"])}
    char = bytes_to_unicode()
    ids = []
    for piece in regex.findall(QWEN_PATTERN, text):
        word = [char[b] for b in piece.encode("utf-8")]
        if "".join(word) in vocab:
            ids.append(vocab["".join(word)])
            continue
        while True:
            pairs = [(merge_rank.get((a, b)), i) for i, (a, b) in enumerate(zip(word, word[1:]))]
            pairs = [p for p in pairs if p[0] is not None]
            if not pairs:
                break
            _, i = min(pairs)
            word[i : i + 2] = [word[i] + word[i + 1]]
        ids += [vocab[w] for w in word]
    return ids


def specials_after(ranks: dict[bytes, int]) -> dict[str, int]:
    return {name: len(ranks) + i for i, name in enumerate(TIKTOKEN_SPECIALS)}


def test_a_token_reachable_by_another_split_encodes_as_tiktoken_does():
    # "abc" was trained as ab + c, but in "abcd" tiktoken merges b + c first (lower rank), then
    # a + bc: the export must list that split too, or the library would stop at [a, bc, d].
    ranks = {bytes([b]): b for b in range(256)} | {b"bc": 256, b"ab": 257, b"abc": 258}
    data = hf_tokenizer_json(ranks, specials_after(ranks))
    assert ["b c", "a b", "a bc", "ab c"] == data["model"]["merges"]
    expected = TiktokenTokenizer("t", ranks, specials_after(ranks)).encode("abcd")
    assert expected == [258, ord("d")]
    assert hf_bpe_reference("abcd", data) == expected


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> tuple[dict, list[str], TiktokenTokenizer]:
    texts = sample_texts(3, n=80)
    ranks = train_bpe(count_pretokens(texts[:60]), 700)
    return ranks, texts, TiktokenTokenizer("t", ranks, specials_after(ranks))


def test_exported_json_encodes_as_tiktoken(fitted, tmp_path):
    ranks, texts, tok = fitted
    data = hf_tokenizer_json(ranks, specials_after(ranks))
    assert len(data["model"]["vocab"]) + len(data["added_tokens"]) == tok.vocab_size
    for text in texts[60:]:  # held out from the fit: pieces the vocabulary lacks whole
        assert hf_bpe_reference(text, data) == tok.encode(text)
    # The engine's own loader reads the export back to the same tokenizer.
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    loaded = build_tokenizer(str(tmp_path / "tokenizer.json"))
    assert loaded.eos_id == tok.eos_id and loaded.vocab_size == tok.vocab_size
    assert all(loaded.encode(t) == tok.encode(t) for t in texts)


def test_tokenizers_library_agrees(fitted, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    ranks, texts, tok = fitted
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(hf_tokenizer_json(ranks, specials_after(ranks))))
    hf = tokenizers.Tokenizer.from_file(str(path))
    for text in texts:
        assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text)
        assert hf.decode(tok.encode(text)) == text
    assert hf.token_to_id("<|endoftext|>") == tok.eos_id
