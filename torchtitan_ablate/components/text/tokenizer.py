"""Tokenizers behind one small interface, all built offline from local files.

`build_tokenizer(path)` accepts:
  "byte"                  byte-level tokenizer (256 bytes + eos/bos/pad), for tests
  *.tiktoken              tiktoken ranks file ("<base64 token> <rank>" per line)
  tokenizer.json          Hugging Face byte-level BPE, converted to tiktoken ranks in memory
  *.model                 sentencepiece model
  a directory             holding tokenizer.json, one *.tiktoken or tokenizer.model
tiktoken's named encodings are never used: they download at first use and fail offline.
"""

from __future__ import annotations

import base64
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import tiktoken

from torchtitan_ablate.components.text.chat_template import ChatTemplate, read_chat_template
from torchtitan_ablate.config import ConfigError

# Qwen2/Qwen3 pre-tokenizer (tokenizer.json "Split" regex): single digits, letters with one
# leading non-letter, punctuation runs, newlines, whitespace.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2's pattern, used by tokenizer.json files whose ByteLevel pre-tokenizer has use_regex=true.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Specials appended after the ranks of a .tiktoken file (Qwen's ids when the ranks are Qwen's).
TIKTOKEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

KEY = "model.tokenizer_path"
_ACCEPTED = (
    "accepted: 'byte', a *.tiktoken ranks file, an HF tokenizer.json, a sentencepiece *.model, "
    "or a directory holding one of them"
)


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs. Every id produced is < vocab_size (specials included)."""

    vocab_size: int
    eos_id: int
    bos_id: int | None
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """ids 0..255 are raw UTF-8 bytes; 256 eos, 257 bos, 258 pad. decode() drops specials."""

    def __init__(self) -> None:
        self.eos_id, self.bos_id, self.pad_id = 256, 257, 258
        self.vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class TiktokenTokenizer:
    """A tiktoken.Encoding built locally from ranks + special tokens.

    encode() treats special-token text in the input as plain text (encode_ordinary), so a
    document cannot inject an EOS by containing the string "<|endoftext|>".
    """

    def __init__(
        self,
        name: str,
        ranks: dict[bytes, int],
        special_tokens: dict[str, int],
        pat_str: str = QWEN_PATTERN,
    ) -> None:
        self.encoding = tiktoken.Encoding(
            name=name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=special_tokens
        )
        self.special_tokens = dict(special_tokens)
        self.chat_template: ChatTemplate | None = None  # set from a tokenizer_config.json
        self.vocab_size = self.encoding.n_vocab
        self.eos_id = _first_special(special_tokens, ("<|endoftext|>", "<|end_of_text|>", "</s>"))
        if self.eos_id is None:
            raise ValueError(f"tokenizer {name}: no end-of-text special token found")
        self.bos_id = _first_special(special_tokens, ("<|begin_of_text|>", "<s>", "<bos>"))
        pad_id = _first_special(special_tokens, ("<|pad|>", "<pad>", "<|finetune_right_pad_id|>"))
        self.pad_id = self.eos_id if pad_id is None else pad_id  # Qwen pads with <|endoftext|>

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(ids))


class SentencePieceTokenizer:
    """A sentencepiece model; pad falls back to eos when the model defines no pad piece."""

    def __init__(self, path: str) -> None:
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=path)
        self.vocab_size = self.sp.get_piece_size()
        if self.sp.eos_id() < 0:
            raise ValueError(f"sentencepiece model {path} defines no eos piece")
        self.eos_id = self.sp.eos_id()
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eos_id

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text, out_type=int)

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode(list(ids))


def _first_special(specials: dict[str, int], names: Sequence[str]) -> int | None:
    return next((specials[n] for n in names if n in specials), None)


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a tiktoken ranks file without tiktoken.load (which caches files under /tmp)."""
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{path}:{line_no}: not a '<base64 token> <rank>' line") from e
    if not ranks:
        raise ValueError(f"{path} holds no token (an empty file), not one '<base64> <rank>' line")
    if len(set(ranks.values())) != len(ranks):
        raise ValueError(f"{path}: duplicate ranks")  # tiktoken would panic instead
    return ranks


def save_tiktoken_ranks(ranks: dict[bytes, int], path: str | Path) -> None:
    """Write ranks in tiktoken's format, sorted by rank (byte-identical for identical ranks)."""
    lines = [
        f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=_by_rank)
    ]
    Path(path).write_text("".join(lines), encoding="ascii")


def _by_rank(item: tuple[bytes, int]) -> int:
    return item[1]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def hf_tokenizer_json_to_ranks(data: dict) -> tuple[dict[bytes, int], dict[str, int], str]:
    """Convert a parsed byte-level BPE tokenizer.json to (ranks, special tokens, regex pattern).

    Ranks are the HF ids: tiktoken merges by rank, which equals HF's merge order for vocabularies
    trained by byte-level BPE (ids assigned in merge order), as for Qwen and GPT-2.
    """
    if not isinstance(data, dict):
        raise ValueError(
            f"a tokenizer.json holds one JSON object, not a {type(data).__name__}; give the "
            "tokenizer.json of a Hugging Face model"
        )
    model = data.get("model") or {}
    if (
        not isinstance(model, dict)
        or model.get("type") != "BPE"
        or "ByteLevel" not in json.dumps(data.get("decoder"))
    ):
        raise ValueError("only byte-level BPE tokenizer.json files can be converted")
    if not isinstance(model.get("vocab"), dict):
        raise ValueError('its "model" has no "vocab" object of token -> id')
    specials = {t["content"]: int(t["id"]) for t in data.get("added_tokens", [])}
    special_ids = set(specials.values())
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    ranks: dict[bytes, int] = {}
    for token, idx in model["vocab"].items():
        if idx in special_ids:
            continue
        try:
            ranks[bytes(byte_of[c] for c in token)] = int(idx)
        except KeyError as e:
            raise ValueError(f"vocab token {token!r} is not byte-level encoded") from e
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"byte-level vocab lacks {len(missing)} single bytes, e.g. {missing[0]}")
    _warn_if_merges_out_of_order(model.get("merges") or [], byte_of, ranks)
    return ranks, specials, _pattern_of(data.get("pre_tokenizer"))


def _warn_if_merges_out_of_order(merges: list, byte_of: dict[str, int], ranks: dict) -> None:
    merged = []
    for m in merges:
        left, right = m.split(" ") if isinstance(m, str) else m
        rank = ranks.get(bytes(byte_of[c] for c in left + right))
        if rank is not None:  # a merge whose result left the vocab does not matter
            merged.append(rank)
    if any(b < a for a, b in zip(merged, merged[1:])):
        warnings.warn(
            "tokenizer.json ids do not follow merge order; tiktoken may encode differently",
            stacklevel=3,
        )


def _pattern_of(pre_tokenizer: dict | None) -> str:
    steps = (pre_tokenizer or {}).get("pretokenizers") or [pre_tokenizer or {}]
    for step in steps:
        if step.get("type") == "Split" and "Regex" in step.get("pattern", {}):
            return step["pattern"]["Regex"]
        if step.get("type") == "ByteLevel" and step.get("use_regex", True):
            return GPT2_PATTERN
    return QWEN_PATTERN


def _resolve_dir(path: Path) -> Path:
    if (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    ranks_files = sorted(path.glob("*.tiktoken"))
    if len(ranks_files) > 1:
        raise ConfigError(
            f"{KEY} = {str(path)!r}: the folder holds several *.tiktoken files; name one; "
            + _ACCEPTED
        )
    if ranks_files:
        return ranks_files[0]
    if (path / "tokenizer.model").is_file():
        return path / "tokenizer.model"
    raise ConfigError(f"{KEY} = {str(path)!r}: the folder holds no tokenizer file; {_ACCEPTED}")


def tokenizer_file(path: str) -> Path | None:
    """The file that model.tokenizer_path names (a folder's tokenizer file); None for "byte"."""
    if path == "byte":
        return None
    p = Path(path)
    return _resolve_dir(p) if p.is_dir() else p


def build_tokenizer(path: str) -> Tokenizer:
    """Build a tokenizer from "byte" or a local file/directory (see the module docstring)."""
    p = tokenizer_file(path)
    if p is None:
        return ByteTokenizer()
    if not p.is_file():
        raise ConfigError(f"{KEY} = {path!r}: no such file or folder; {_ACCEPTED}")
    try:
        if p.suffix == ".tiktoken":
            ranks = load_tiktoken_ranks(p)
            return TiktokenTokenizer(p.stem, ranks, _specials_after(ranks))
        if p.suffix == ".json":
            try:
                data = json.loads(p.read_text("utf-8"))
            except json.JSONDecodeError as e:
                raise ValueError(f"{p} is not valid JSON ({e})") from None
            ranks, specials, pattern = hf_tokenizer_json_to_ranks(data)
            tok = TiktokenTokenizer(p.parent.name or p.stem, ranks, specials, pattern)
            tok.chat_template = read_chat_template(p.parent)  # SFT renders chats with it
            return tok
        if p.suffix == ".model":
            return SentencePieceTokenizer(str(p))
    except (OSError, RuntimeError, ValueError, KeyError, TypeError) as e:
        # One line: sentencepiece's and tiktoken's messages can span several.
        why = " ".join(str(e).split()) or type(e).__name__
        raise ConfigError(
            f"{KEY} = {path!r}: cannot read it as a tokenizer: {why}; {_ACCEPTED}"
        ) from e
    raise ConfigError(f"{KEY} = {path!r}: unknown tokenizer format ({p.name}); {_ACCEPTED}")


def _specials_after(ranks: dict[bytes, int]) -> dict[str, int]:
    first = max(ranks.values()) + 1
    return {name: first + i for i, name in enumerate(TIKTOKEN_SPECIALS)}
