"""Preference data for DPO: JSONL pairs -> (chosen, rejected) token sequences -> packed rows.

Input: .jsonl files (or folders of them), one pair per line, in either of TRL's formats:
    {"prompt": "...", "chosen": "...", "rejected": "..."}                        (standard)
    {"prompt": [{"role": "user", "content": "..."}, ...],
     "chosen": [{"role": "assistant", "content": "..."}], "rejected": [...]}      (conversational)
Standard: prompt and response are tokenized separately, the response followed by the
tokenizer's end-of-text token (TRL appends EOS too). Conversational: prompt + chosen (and
prompt + rejected) rendered as SFT renders a chat (sft.ChatRenderer: the tokenizer's
chat_template, else Qwen's chat format). Trained (scored) tokens: the response only, i.e. the
assistant replies of "chosen" / "rejected" through their <|im_end|>; a prompt's own assistant
turns are context.

Bad rows (invalid JSON, a missing, mistyped or empty field, a pair longer than seq_len) are
found before training (`check_lines` reads all of the data): with max_bad_rows = 0 the first is
one DatasetError naming its file and line; else up to max_bad_rows are skipped and counted.

Rows (sft.build_row's dict plus num_pairs): each sequence is its own document (positions from
0, attention masked), chosen of pair k is document 2k and its rejected document 2k + 1, so a
pair is never split over rows; padding is the last segment. `num_pairs` [1 per row] is what
the loss is divided by (objective/dpo.py). Packing as for chat (greedy / best_fit / padding:
one pair per row, chosen and rejected as two documents), the pair being the unit. State
(source position + open rows) resumes exactly.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from torchtitan_ablate.components.data.datasets import KEY, DatasetError, TextDocuments
from torchtitan_ablate.components.data.sft import (
    ChatRenderer,
    Conversation,
    SFTDataset,
    build_row,
)
from torchtitan_ablate.components.text.tokenizer import Tokenizer

logger = logging.getLogger("torchtitan_ablate")

Pair = tuple[list[int], list[bool], int]  # chosen then rejected tokens, trained mask, len(chosen)
FIELDS = ("prompt", "chosen", "rejected")
FORMAT = (
    'expected {"prompt", "chosen", "rejected"} as strings, or as lists of '
    '{"role", "content"} messages (TRL\'s conversational format)'
)


class BadRow(ValueError):
    """Why one row cannot be used (the caller adds file and line)."""


class PairRenderer:
    """A JSON row -> Pair, or BadRow."""

    def __init__(self, tokenizer: Tokenizer, seq_len: int) -> None:
        self.tokenizer, self.seq_len = tokenizer, seq_len
        self._chat: ChatRenderer | None = None  # made on the first conversational row

    def __call__(self, raw: bytes) -> Pair:
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadRow(f"not a valid UTF-8 JSON line ({e})") from None
        if not isinstance(row, dict) or any(f not in row for f in FIELDS):
            missing = [f for f in FIELDS if not isinstance(row, dict) or f not in row]
            raise BadRow(f"missing {missing}; {FORMAT}")
        prompt, chosen, rejected = (row[f] for f in FIELDS)
        if all(isinstance(x, str) for x in (prompt, chosen, rejected)):
            render = self._text
        elif all(_is_messages(x) for x in (prompt, chosen, rejected)):
            render = self._messages
        else:
            raise BadRow(FORMAT)
        c_tokens, c_mask = render(prompt, chosen, "chosen")
        r_tokens, r_mask = render(prompt, rejected, "rejected")
        n = len(c_tokens) + len(r_tokens)
        if n > self.seq_len:
            raise BadRow(
                f"the pair is {n} tokens (chosen {len(c_tokens)} + rejected {len(r_tokens)}), "
                f"longer than training.seq_len = {self.seq_len}"
            )
        return c_tokens + r_tokens, c_mask + r_mask, len(c_tokens)

    def _text(self, prompt: str, response: str, name: str) -> Conversation:
        if not prompt:
            raise BadRow('empty "prompt"')
        if not response.strip():
            raise BadRow(f"empty {name!r} response")
        p = self.tokenizer.encode(prompt)
        r = self.tokenizer.encode(response) + [self.tokenizer.eos_id]
        return p + r, [False] * len(p) + [True] * len(r)

    def _messages(self, prompt: list, response: list, name: str) -> Conversation:
        replies = [m for m in response if m["role"] == "assistant"]
        if not prompt:
            raise BadRow('empty "prompt" (no messages)')
        if not replies or any(not m["content"].strip() for m in replies):
            raise BadRow(f"{name!r} has no assistant message, or an empty one")
        if self._chat is None:
            self._chat = ChatRenderer(self.tokenizer)
        tokens, mask = self._chat(prompt + response)
        return tokens, _last_runs(mask, len(replies))


def _is_messages(x: Any) -> bool:
    return isinstance(x, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in x
    )


def _last_runs(mask: list[bool], k: int) -> list[bool]:
    """mask with only its last k runs of True kept (the response's replies; earlier runs are
    assistant turns of the prompt, which are context)."""
    out, runs = list(mask), 0
    for i in range(len(mask) - 1, -1, -1):
        if mask[i] and (i == len(mask) - 1 or not mask[i + 1]):
            runs += 1
        if runs > k:
            out[i] = False
    return out


class PreferencePairs(TextDocuments):
    """Pairs from .jsonl files; sharded and resumable as TextDocuments (same state)."""

    def __init__(
        self, files: list[Path], tokenizer: Tokenizer, seq_len: int, max_bad_rows: int = 0
    ) -> None:
        bad = [str(f) for f in files if f.suffix != ".jsonl"]
        if bad:
            raise DatasetError(
                f"{KEY}: training.dataset = 'preference' reads .jsonl files only, got {bad[:3]}"
            )
        super().__init__(files, tokenizer)
        self.render = PairRenderer(tokenizer, seq_len)
        self.max_bad_rows = max_bad_rows
        self.bad_rows: list[str] = []  # "file:line: why", found by check_lines

    empty_item_name = "usable preference pair"

    def check_lines(self, max_bytes: int | None = None) -> bool:
        """Reads all of the data (whatever max_bytes: a pair's length needs its tokens), so the
        rows skipped in training are exactly the ones counted here."""
        self.bad_rows = []
        super().check_lines(max_bytes=2**62)
        if self.bad_rows:
            shown = "; ".join(self.bad_rows[:5]) + (" ..." if len(self.bad_rows) > 5 else "")
            logger.warning(
                f"data: skipping {len(self.bad_rows)} bad preference rows (dpo.max_bad_rows = "
                f"{self.max_bad_rows}): {shown}"
            )
        return True

    def _check_line(self, path: Path, raw: bytes, line_no: int) -> None:
        try:
            self.render(raw)
        except BadRow as e:
            where = f"{path}:{line_no}: {e}"
            if len(self.bad_rows) >= self.max_bad_rows:
                more = (
                    f"; {len(self.bad_rows) + 1} bad rows, more than dpo.max_bad_rows = "
                    f"{self.max_bad_rows}"
                    if self.max_bad_rows
                    else "; dpo.max_bad_rows = N skips up to N such rows"
                )
                raise DatasetError(f"{KEY}: {where}{more}") from None
            self.bad_rows.append(where)

    def _to_item(self, path: Path, raw: bytes, first_line: int) -> Pair | None:
        try:
            return self.render(raw)
        except BadRow as e:
            if not self.max_bad_rows:  # check_lines raised already, unless it was not called
                raise DatasetError(f"{KEY}: {path}:{first_line}: {e}") from None
            return None  # counted by check_lines


def pair_row(pairs: list[Pair], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One row: chosen and rejected of each pair as documents 2k and 2k + 1."""
    docs = [d for t, m, n in pairs for d in ((t[:n], m[:n]), (t[n:], m[n:]))]
    row = build_row(docs, seq_len, pad_id)
    row["num_pairs"] = torch.tensor(len(pairs), dtype=torch.long)
    return row


def synthetic_pair_keys(batch_size: int, seq_len: int, device: torch.device) -> dict:
    """The keys a preference batch has beyond a text batch's, for synthetic batches of the
    configured shape (the memory estimate): one pair per row, each sequence half the row."""
    half = torch.arange(seq_len, device=device) >= seq_len // 2
    return {
        "document_ids": half.long().repeat(batch_size, 1),
        "num_pairs": torch.ones(batch_size, dtype=torch.long, device=device),
    }


class PreferenceDataset(SFTDataset):
    """Packs pairs into rows as SFTDataset packs conversations (greedy / best_fit / padding,
    same placement), a pair being the unit; stateful."""

    source: PreferencePairs
    open_rows: list[list[Pair]]  # pairs read but not yet emitted

    def _emit(self, row: list[Pair]) -> dict[str, torch.Tensor]:
        return pair_row(row, self.seq_len, self.pad_id)
