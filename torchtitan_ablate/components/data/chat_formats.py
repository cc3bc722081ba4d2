"""The chat layouts SFT reads, each turned into {"role", "content"} messages (sft.py renders them).

Detected per row, by the key it has (checked in this order):
    messages       {"messages": [{"role": "user", "content": "..."}, ...]}   (TRL, OpenAI)
    conversations  {"conversations": [{"from": "human", "value": "..."}, ...]}   (ShareGPT)
                   from: system -> system, human / user -> user, gpt / assistant -> assistant
    instruction    {"instruction": "...", "input": "..." (optional), "output": "..."}   (Alpaca)
                   one user turn (instruction, then "\\n\\n" and input when input is not empty)
                   and one assistant turn (output), as axolotl's alpaca prompt has them
A row with none of them, or with one of them malformed, gives None: the caller names its file
and line.
"""

from __future__ import annotations

from typing import Any

Messages = list[dict[str, str]]

LAYOUTS = (
    'expected {"messages": [{"role": str, "content": str}, ...]}, ShareGPT\'s '
    '{"conversations": [{"from": "system" | "human" | "gpt", "value": str}, ...]} or Alpaca\'s '
    '{"instruction": str, "input": str (optional), "output": str}'
)
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}


def to_messages(record: Any) -> Messages | None:
    """The row's conversation as messages, or None when it is in none of the layouts."""
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        messages = record["messages"]
        ok = isinstance(messages, list) and all(_has_str(m, "role", "content") for m in messages)
        return messages if ok and messages else None
    if "conversations" in record:
        return _sharegpt(record["conversations"])
    if "instruction" in record:
        return _alpaca(record)
    return None


def _has_str(m: Any, *keys: str) -> bool:
    return isinstance(m, dict) and all(isinstance(m.get(k), str) for k in keys)


def _sharegpt(turns: Any) -> Messages | None:
    if not isinstance(turns, list) or not turns:
        return None
    if not all(_has_str(t, "from", "value") and t["from"] in SHAREGPT_ROLES for t in turns):
        return None
    return [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]


def _alpaca(record: dict) -> Messages | None:
    instruction, extra, output = record["instruction"], record.get("input"), record.get("output")
    if not (isinstance(instruction, str) and isinstance(output, str)):
        return None
    if extra is not None and not isinstance(extra, str):
        return None
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
