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

A template is code from the tokenizer folder, so it is tried before training (rendered on
SAMPLE when the renderer is made, i.e. when the data loader is built, before the model) and
every failure is one line naming its file (ChatTemplateError, exit code 2): a syntax error, the
sandbox's SecurityError, the template's own raise_exception, any other error, and a render that
takes longer than RENDER_SECONDS (a loop that does not end; timed with SIGALRM on the thread
that renders when it is the main thread, as in the trainer and its loader workers).
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from torchtitan_ablate.config import ConfigError

KEY = "model.tokenizer_path"
RENDER_SECONDS = 10.0  # for one render; a chat takes milliseconds
SAMPLE = [
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "It is 4."},
]
_FIX = "fix it, or remove chat_template to render chats in the built-in Qwen format"


class ChatTemplateError(ConfigError):
    """A chat template that cannot render: one line naming its tokenizer_config.json."""


class _Raised(Exception):
    """The template's own raise_exception(message)."""


class _TooSlow(Exception):
    pass


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
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise _Raised(message)

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


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raises _TooSlow in the block after `seconds` (on the main thread; elsewhere no limit)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def too_slow(signum: int, frame: object) -> None:
        raise _TooSlow

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)


def _describe(e: BaseException) -> str:
    if isinstance(e, _Raised):
        return f"the template raised {str(e)!r}"
    text = (str(e).strip().splitlines() or [""])[0][:300]
    line = getattr(e, "lineno", None)  # jinja2's TemplateSyntaxError
    return f"{type(e).__name__}{f' at line {line}' if line else ''}: {text}"


class TemplateRenderer:
    """Messages -> (text, assistant spans as [start, end) character offsets). ImportError
    without jinja2; ChatTemplateError when the template fails on SAMPLE."""

    def __init__(
        self, template: ChatTemplate, end: str = "<|im_end|>", seconds: float | None = None
    ) -> None:
        self.template, self.end = template, end
        self.seconds = RENDER_SECONDS if seconds is None else seconds
        self.what = "a sample conversation (tried before training)"
        try:
            self.compiled = _compile(template.source)
        except ImportError:
            raise
        except Exception as e:
            raise ChatTemplateError(self._failed(f"does not compile: {_describe(e)}")) from None
        self(SAMPLE)
        self.what = "a conversation"

    def _failed(self, why: str) -> str:
        return f"{KEY}: the chat_template of {self.template.origin} {why}; {_FIX}"

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            with _time_limit(self.seconds):
                return self.compiled.render(
                    messages=messages, add_generation_prompt=add_generation_prompt,
                    tools=None, documents=None, **self.template.variables,
                )  # fmt: skip
        except _TooSlow:
            why = f"took more than {self.seconds:g} s to render {self.what} (an endless loop?)"
            raise ChatTemplateError(self._failed(why)) from None
        except Exception as e:
            raise ChatTemplateError(self._failed(f"fails on {self.what}: {_describe(e)}")) from None

    def __call__(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        text = self.render(messages, add_generation_prompt=False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            if not text.startswith(prompt):
                why = (
                    f"renders the prompt of assistant message {i} of {self.what} differently "
                    "from the whole conversation, so its reply cannot be located"
                )
                raise ChatTemplateError(self._failed(why))
            stop = text.find(self.end, len(prompt))
            spans.append((len(prompt), len(text) if stop < 0 else stop + len(self.end)))
        return text, spans
