"""A tokenizer folder's own chat template (tokenizer_config.json's "chat_template"), rendered as
transformers' `apply_chat_template` renders it, with the assistant replies located in the text.

Rendering follows transformers (utils/chat_template_utils.py): a sandboxed jinja2 environment
with trim_blocks and lstrip_blocks, the loopcontrols extension, `raise_exception`, `tojson`
and `strftime_now`, and the config's special tokens (bos_token, eos_token, ...) as variables.
jinja2 comes with transformers; without it the SFT renderer keeps its built-in Qwen format.

Assistant spans: a reply starts where the prompt for it ends, i.e. after
render(messages[:i], add_generation_prompt=True), which must be a prefix of the whole
conversation's text (templates that rewrite earlier turns, as Qwen3's does with <think>, keep
this), and ends after the first `end` marker (<|im_end|>) from there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from torchtitan_ablate.config import ConfigError

KEY = "model.tokenizer_path"


@dataclass
class ChatTemplate:
    source: str  # the jinja2 text
    variables: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ...
    origin: str = ""  # the tokenizer_config.json it came from, for error messages


def read_chat_template(folder: Path) -> ChatTemplate | None:
    """The chat template of `folder`/tokenizer_config.json; None when it has none."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{KEY}: {path}: not a readable JSON file ({e})") from None
    source = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str):
        return None
    variables = {}
    for key, value in config.items():
        if key.endswith("_token"):
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                variables[key] = value
    return ChatTemplate(source, variables, str(path))


def _compile(source: str) -> Any:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])  # fmt: skip
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class TemplateRenderer:
    """Messages -> (text, assistant spans as [start, end) character offsets)."""

    def __init__(self, template: ChatTemplate, end: str = "<|im_end|>") -> None:
        self.template, self.end = template, end
        self.compiled = _compile(template.source)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            tools=None, documents=None, **self.template.variables,
        )  # fmt: skip

    def __call__(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        text = self.render(messages, add_generation_prompt=False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            if not text.startswith(prompt):
                raise ConfigError(
                    f"{KEY}: the chat_template of {self.template.origin} renders the prompt of "
                    f"assistant message {i} differently from the whole conversation, so its "
                    "reply cannot be located; remove chat_template to use the built-in format"
                )
            stop = text.find(self.end, len(prompt))
            spans.append((len(prompt), len(text) if stop < 0 else stop + len(self.end)))
        return text, spans
