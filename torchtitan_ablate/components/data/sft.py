"""Supervised fine-tuning data: chat JSONL -> Qwen chat format -> rows with assistant-only labels.

Input: .jsonl files (or folders of them), one conversation per line:
    {"messages": [{"role": "system" | "user" | "assistant" | ..., "content": "..."}, ...]}
or in ShareGPT's or Alpaca's layout, detected per line (chat_formats.py).
Rendering: with the tokenizer folder's own chat_template (tokenizer_config.json) when it has one,
trained tokens being each assistant reply through its <|im_end|> (components/text/chat_template.py);
else Qwen's chat format (no thinking tags added), per message:
    <|im_start|>{role}\\n{content}<|im_end|>\\n
with <|im_start|> / <|im_end|> taken from the tokenizer's own special tokens. Trained tokens are
each assistant message's content and its <|im_end|>; everything else (system, user, the role
headers, the newline after <|im_end|>) is labelled -100. A conversation is cut to seq_len tokens;
one with no trained token left is skipped.

Rows (same dict as packing.py: input_ids, labels, positions, document_ids; [S] each):
  greedy    conversations in order; one never spans two rows: when the next does not fit, the
            row is padded and closed
  best_fit  up to BEST_FIT_OPEN_ROWS rows stay open; each conversation goes into the open row it
            fills best; when none has room the fullest row is emitted (less padding than greedy)
  padding   one conversation per row
Every conversation is its own document (attention masked, positions from 0); padding is one more
segment with labels -100. State (source position + open rows) resumes exactly, as in packing.py.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset

from torchtitan_ablate.components.data.chat_formats import LAYOUTS, to_messages
from torchtitan_ablate.components.data.datasets import KEY, DatasetError, TextDocuments
from torchtitan_ablate.components.data.packing import (
    IGNORE_INDEX,
    segment_positions,
    shard_for_this_worker,
    warn_if_dp_changed,
)
from torchtitan_ablate.components.text.chat_template import TemplateRenderer
from torchtitan_ablate.components.text.tokenizer import Tokenizer
from torchtitan_ablate.config import ConfigError

SFT_PACKING_MODES = ("greedy", "best_fit", "padding")
BEST_FIT_OPEN_ROWS = 16
Conversation = tuple[list[int], list[bool]]  # tokens, trained (is an assistant token)


def special_token_id(tokenizer: Tokenizer, name: str) -> int:
    """The id of special token `name` as the tokenizer's files define it; ConfigError if absent."""
    specials = getattr(tokenizer, "special_tokens", None) or {}
    if name in specials:
        return specials[name]
    sp = getattr(tokenizer, "sp", None)  # sentencepiece: user-defined pieces
    if sp is not None and sp.piece_to_id(name) != sp.unk_id():
        return sp.piece_to_id(name)
    raise ConfigError(
        f"model.tokenizer_path: the tokenizer ({type(tokenizer).__name__}) defines no special "
        f"token {name}; training.dataset = 'chat' needs <|im_start|> and <|im_end|> (Qwen's "
        "tokenizer.json has them)"
    )


class ChatRenderer:
    """Messages -> (tokens, trained mask): with the tokenizer folder's chat_template when it has
    one (components/text/chat_template.py), else in the built-in Qwen chat format."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.im_start = special_token_id(tokenizer, "<|im_start|>")
        self.im_end = special_token_id(tokenizer, "<|im_end|>")
        self.newline = tokenizer.encode("\n")
        self.template = _template_renderer(tokenizer)
        specials = getattr(tokenizer, "special_tokens", None) or {}
        self.specials = dict(specials)
        longest_first = sorted(specials, key=len, reverse=True)
        self.special_re = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")

    def __call__(self, messages: list[dict[str, str]]) -> Conversation:
        if self.template is not None:
            return self._from_template(messages)
        tokens: list[int] = []
        mask: list[bool] = []
        for m in messages:
            header = [self.im_start] + self.tokenizer.encode(m["role"] + "\n")
            body = self.tokenizer.encode(m["content"]) + [self.im_end]
            trained = m["role"] == "assistant"
            tokens += header + body + self.newline
            mask += [False] * len(header) + [trained] * len(body) + [False] * len(self.newline)
        return tokens, mask

    def generation_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The ids a reply is generated after: the chat and the assistant turn's opening, as
        apply_chat_template(messages, add_generation_prompt=True). The reply ends at im_end."""
        if self.template is not None:
            return self._encode(self.template.render(messages, add_generation_prompt=True))
        return self(messages)[0] + [self.im_start] + self.tokenizer.encode("assistant\n")

    def _from_template(self, messages: list[dict[str, str]]) -> Conversation:
        text, spans = self.template(messages)
        cuts = [0, *(c for span in spans for c in span), len(text)]
        tokens: list[int] = []
        mask: list[bool] = []
        for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
            piece = self._encode(text[a:b])
            tokens += piece
            mask += [k % 2 == 1] * len(piece)  # odd pieces are the assistant spans
        return tokens, mask

    def _encode(self, text: str) -> list[int]:
        """Text with special tokens written out (<|im_start|>) -> ids, the specials as one id
        (as transformers tokenizes a rendered template, message contents included)."""
        ids: list[int] = []
        for k, part in enumerate(self.special_re.split(text)):
            if k % 2 == 1:
                ids.append(self.specials[part])
            elif part:
                ids += self.tokenizer.encode(part)
        return ids


def _template_renderer(tokenizer: Tokenizer) -> TemplateRenderer | None:
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        return None
    try:
        return TemplateRenderer(template)
    except ImportError:  # jinja2 comes with transformers
        warnings.warn(
            f"{template.origin} has a chat_template but jinja2 is not installed; rendering "
            "chats in the built-in Qwen format (pip install jinja2 to use the template)",
            stacklevel=3,
        )
        return None


class ChatDocuments(TextDocuments):
    """Conversations from .jsonl files as (tokens, mask); sharded and resumable as TextDocuments
    (same state: file, byte offset, line, document index)."""

    def __init__(self, files: list[Path], tokenizer: Tokenizer, seq_len: int) -> None:
        bad = [str(f) for f in files if f.suffix != ".jsonl"]
        if bad:
            raise DatasetError(
                f"{KEY}: training.dataset = 'chat' reads .jsonl files only, got {bad[:3]}"
            )
        super().__init__(files, tokenizer)
        self.render = ChatRenderer(tokenizer)
        self.seq_len = seq_len

    empty_item_name = "conversation with an assistant token"

    def _check_line(self, path: Path, raw: bytes, line_no: int) -> None:
        _messages(path, raw, line_no)

    def _to_item(self, path: Path, raw: bytes, first_line: int) -> Conversation | None:
        tokens, mask = self.render(_messages(path, raw, first_line))
        tokens, mask = tokens[: self.seq_len], mask[: self.seq_len]
        return (tokens, mask) if any(mask[1:]) else None  # at least one trained label


def _messages(path: Path, raw: bytes, line_no: int) -> list[dict[str, str]]:
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(f"{KEY}: {path}:{line_no}: not a valid UTF-8 JSON line ({e})") from None
    messages = to_messages(record)
    if messages is None:
        hint = (
            "; this is a plain-text line: use training.dataset = 'text'"
            if isinstance(record, dict) and "text" in record
            else ""
        )
        raise DatasetError(f"{KEY}: {path}:{line_no}: {LAYOUTS}{hint}")
    return messages


def build_row(convs: list[Conversation], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One row from conversations whose lengths sum to <= seq_len (label t = token t + 1 when
    that token is trained, inside the same conversation)."""
    input_ids = torch.full((seq_len,), pad_id, dtype=torch.long)
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
    doc_ids = torch.full((seq_len,), len(convs), dtype=torch.long)  # padding: the last segment
    start = 0
    for d, (tokens, mask) in enumerate(convs):
        n = len(tokens)
        t = torch.tensor(tokens, dtype=torch.long)
        input_ids[start : start + n] = t
        trained = torch.tensor(mask[1:], dtype=torch.bool)
        labels[start : start + n - 1] = torch.where(trained, t[1:], IGNORE_INDEX)
        doc_ids[start : start + n] = d
        start += n
    return {
        "input_ids": input_ids,
        "labels": labels,
        "positions": segment_positions(doc_ids),
        "document_ids": doc_ids,
    }


class SFTDataset(IterableDataset):
    """Packs conversations into rows (greedy / best_fit / padding); stateful."""

    def __init__(
        self,
        source: ChatDocuments,
        seq_len: int,
        packing: str,
        pad_id: int,
        dp_rank: int,
        dp_world_size: int,
    ) -> None:
        if packing not in SFT_PACKING_MODES:
            raise ConfigError(
                f"training.packing = {packing!r}: training.dataset = 'chat' needs one of "
                f"{SFT_PACKING_MODES}"
            )
        self.source, self.seq_len, self.packing, self.pad_id = source, seq_len, packing, pad_id
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.max_open = {"padding": 0, "greedy": 1, "best_fit": BEST_FIT_OPEN_ROWS}[packing]
        self.open_rows: list[list[Conversation]] = []  # conversations read but not yet emitted

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        shard_for_this_worker(self.source, self.dp_rank, self.dp_world_size)
        for conv in self.source:
            for row in self.add(conv):
                yield self._emit(row)

    def add(self, conv: Conversation) -> Iterator[list[Conversation]]:
        """Places `conv` (a conversation; a preference pair) and yields the rows that closed,
        in order (epochs.py counts them). State is updated before every yield: the yielded row
        is gone, `conv` is held."""
        row = self._place(conv, self.max_open)
        if row is not None:
            yield row
        full = [r for r in self.open_rows if self._room(r) == 0]
        for r in full:
            self.open_rows.remove(r)
            yield r

    def _emit(self, row: list[Conversation]) -> dict[str, torch.Tensor]:
        """The row's tensors (preference.py's subclass lays out pairs)."""
        return build_row(row, self.seq_len, self.pad_id)

    def _room(self, row: list) -> int:
        # A unit's tokens come first (a conversation; a preference pair).
        return self.seq_len - sum(len(unit[0]) for unit in row)

    def _place(self, conv: Conversation, max_open: int) -> list[Conversation] | None:
        """Puts `conv` into an open row (best fit); returns a row to emit if one must make way."""
        if max_open == 0:
            return [conv]
        fits = [r for r in self.open_rows if self._room(r) >= len(conv[0])]
        if fits:
            min(fits, key=self._room).append(conv)
            return None
        emitted = None
        if len(self.open_rows) == max_open:
            emitted = min(self.open_rows, key=self._room)  # the fullest row
            self.open_rows.remove(emitted)
        self.open_rows.append([conv])
        return emitted

    def state_dict(self) -> dict[str, Any]:
        return {
            "source": self.source.state_dict(),
            "open_rows": _copy_rows(self.open_rows),
            "dp": [self.dp_rank, self.dp_world_size],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        warn_if_dp_changed(state["dp"], self.dp_rank, self.dp_world_size)
        self.source.load_state_dict(state["source"])
        self.open_rows = _copy_rows(state["open_rows"])


def _copy_rows(rows: list[list]) -> list[list[tuple]]:
    """Open rows as fresh tuples of lists (token and mask lists copied, ints kept), whether
    they come from the dataset or from a saved state."""
    return [
        [tuple(list(f) if isinstance(f, list | tuple) else f for f in u) for u in r] for r in rows
    ]
