"""Fitting a byte-level BPE offline and writing it for both tokenizer loaders.

Used by the asset builders (scripts/make_debug_assets.py, scripts/make_bench_corpus.py):
  count_pretokens(texts)          Qwen's pre-tokenizer regex over the texts, counted
  train_bpe(counts, num_ranks)    merges in order of pair frequency, ties to the smallest bytes
  hf_tokenizer_json(ranks, ...)   the same ranks as a Hugging Face tokenizer.json, for engines
                                  that load one (the torchtitan peer)
  write_atomically(path, write)   an interrupted build never leaves a truncated file
"""

from __future__ import annotations

import collections
import heapq
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import regex

from torchtitan_ablate.components.text.tokenizer import QWEN_PATTERN, bytes_to_unicode

Pair = tuple[bytes, bytes]


def count_pretokens(texts: Iterable[str]) -> collections.Counter:
    """How often each pre-token (a regex piece of QWEN_PATTERN) occurs in the texts."""
    pattern = regex.compile(QWEN_PATTERN)
    counts: collections.Counter = collections.Counter()
    for text in texts:
        counts.update(pattern.findall(text))
    return counts


def train_bpe(counts: collections.Counter, num_ranks: int) -> dict[bytes, int]:
    """Byte-level BPE over unique pre-tokens: ranks 0..255 are the bytes, then each merge takes
    the most frequent adjacent pair (ties: the smallest pair of bytes) until num_ranks ranks.

    Pair counts are kept up to date incrementally (only the words holding the merged pair are
    re-counted), so tens of thousands of unique pre-tokens train in seconds to minutes.
    """
    keys = sorted(counts)
    words = [[bytes([b]) for b in w.encode("utf-8")] for w in keys]
    freqs = [counts[w] for w in keys]
    pair_counts: dict[Pair, int] = collections.defaultdict(int)
    holders: dict[Pair, set[int]] = collections.defaultdict(set)  # words that may hold the pair
    for i, parts in enumerate(words):
        for pair in zip(parts, parts[1:]):
            pair_counts[pair] += freqs[i]
            holders[pair].add(i)
    # Max-heap by count, then min pair: (-count, pair). An entry may be stale: counts of old
    # pairs only fall, so a popped entry above its pair's count is pushed back at the count.
    heap = [(-c, p) for p, c in pair_counts.items()]
    heapq.heapify(heap)
    ranks = {bytes([b]): b for b in range(256)}
    while len(ranks) < num_ranks and heap:
        neg, best = heapq.heappop(heap)
        count = pair_counts.get(best, 0)
        if count != -neg:
            if 0 < count < -neg:
                heapq.heappush(heap, (-count, best))
            continue
        merged = best[0] + best[1]
        if merged not in ranks:  # a merge may rebuild a token another merge already made
            ranks[merged] = len(ranks)
        grown: set[Pair] = set()
        for i in sorted(holders.pop(best)):
            _remerge(i, words, freqs[i], best, merged, pair_counts, holders, grown)
        pair_counts.pop(best, None)
        for pair in grown:
            if pair_counts.get(pair, 0) > 0:
                heapq.heappush(heap, (-pair_counts[pair], pair))
    return ranks


def _remerge(
    i: int,
    words: list[list[bytes]],
    freq: int,
    best: Pair,
    merged: bytes,
    pair_counts: dict[Pair, int],
    holders: dict[Pair, set[int]],
    grown: set[Pair],
) -> None:
    """Merge `best` left to right in word i and move its pair counts from old to new pairs."""
    parts = words[i]
    out, j = [], 0
    while j < len(parts):
        if j + 1 < len(parts) and parts[j] == best[0] and parts[j + 1] == best[1]:
            out.append(merged)
            j += 2
        else:
            out.append(parts[j])
            j += 1
    if len(out) == len(parts):
        return  # a stale holder: an earlier merge already took the pair apart here
    for pair in zip(parts, parts[1:]):
        pair_counts[pair] -= freq
        if pair_counts[pair] <= 0:
            del pair_counts[pair]
    for pair in zip(out, out[1:]):
        pair_counts[pair] += freq
        holders[pair].add(i)
        grown.add(pair)
    words[i] = out


def hf_tokenizer_json(ranks: dict[bytes, int], specials: dict[str, int]) -> dict:
    """A Hugging Face tokenizer.json that encodes exactly as tiktoken does with these ranks
    and QWEN_PATTERN: a Qwen-style pre-tokenizer (regex split, then byte-level without regex),
    whole pieces found in the vocabulary kept whole (ignore_merges, as tiktoken), and a merge
    listed for EVERY split of a token into two tokens, ordered by the token's rank, so the
    tokenizers library's pair choice (lowest listed merge) equals tiktoken's (lowest rank of
    the pair's concatenation)."""
    char = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(char[b] for b in token)

    merges = []
    for token, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        for cut in range(1, len(token)):
            if token[:cut] in ranks and token[cut:] in ranks:
                merges.append(f"{text(token[:cut])} {text(token[cut:])}")
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    split = {"type": "Split", "pattern": {"Regex": QWEN_PATTERN}, "behavior": "Isolated"}
    added = [
        {"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False}
        | {"normalized": False, "special": True}
        for name, i in sorted(specials.items(), key=lambda kv: kv[1])
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [split | {"invert": False}, {"type": "ByteLevel", **byte_level}],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": {text(t): r for t, r in sorted(ranks.items(), key=lambda kv: kv[1])},
            "merges": merges,
        },
    }


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """write(tmp) beside path, then rename: an interrupted run never leaves a truncated file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not mkstemp: its 0600 mode would survive the rename; a plain file gets the umask's mode.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
