"""SFT with the tokenizer folder's own chat_template: the text and ids are transformers'
apply_chat_template output, and only the assistant replies (through <|im_end|>) are trained. A
template that cannot render is one line naming its file, found before training, and a render
has a time limit."""

import json
import time
from pathlib import Path

import pytest

from tests.helpers.data import CONV, loader
from tests.helpers.hf_tokenizer import make_chat_tokenizer_folder
from torchtitan_ablate.components.data.sft import ChatRenderer
from torchtitan_ablate.components.text.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    TemplateRenderer,
)
from torchtitan_ablate.components.text.tokenizer import build_tokenizer
from torchtitan_ablate.config import ConfigError

# Qwen3's template in short: the last reply (after the last user turn) gets an empty think block,
# earlier replies do not, so a reply renders differently as the last message than mid-chat.
QWEN3_STYLE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _folder(tmp_path: Path, template: object) -> Path:
    """A tiny Qwen-layout tokenizer with the chat specials and `template`."""
    return make_chat_tokenizer_folder(tmp_path, template, [m["content"] for m in CONV] * 20)


def test_template_output_matches_transformers_and_only_replies_are_trained(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = _folder(tmp_path, QWEN3_STYLE)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok = build_tokenizer(str(folder))
    tokens, mask = ChatRenderer(tok)(CONV)
    assert tok.decode(tokens) == hf.apply_chat_template(CONV, tokenize=False)
    assert tokens == hf(hf.apply_chat_template(CONV, tokenize=False))["input_ids"]
    runs, current = [], []
    for t, m in zip(tokens, mask, strict=True):
        if m:
            current.append(t)
        elif current:
            runs, current = [*runs, tok.decode(current)], []
    assert runs == ["It is 4.<|im_end|>", "<think>\n\n</think>\n\nIt is 6.<|im_end|>"]


def test_the_generation_prompt_is_transformers_one(tmp_path):
    """What generate.py --chat replies after: apply_chat_template(add_generation_prompt=True)."""
    transformers = pytest.importorskip("transformers")
    folder = _folder(tmp_path, QWEN3_STYLE)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    prompt = CONV[:-1]  # ends with the user's turn
    text = hf.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert (
        ChatRenderer(build_tokenizer(str(folder))).generation_prompt(prompt)
        == hf(text)["input_ids"]
    )


def test_named_templates_and_no_template(tmp_path):
    tok = build_tokenizer(str(_folder(tmp_path / "a", [{"name": "default", "template": "x"}])))
    assert tok.chat_template is not None and tok.chat_template.source == "x"
    tok = build_tokenizer(str(_folder(tmp_path / "b", None)))
    assert tok.chat_template is None  # the built-in Qwen format
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONV)
    assert tok.decode(ChatRenderer(tok)(CONV)[0]) == text


def test_a_template_that_rewrites_the_prompt_is_one_clear_error(tmp_path):
    # The prompt for a reply must be a prefix of the whole chat, or the reply cannot be found.
    bad = "{{ messages | length }}{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}"
    tok = build_tokenizer(str(_folder(tmp_path, bad)))
    with pytest.raises(ConfigError, match="assistant message 1 of a sample conversation"):
        ChatRenderer(tok)  # tried before training


REPLY = "{% for m in messages %}{{ m.role }}: {{ m.content }}<|im_end|>{% endfor %}"
BROKEN = {
    "syntax": ("{% for m in %}", "does not compile: TemplateSyntaxError at line 1: Expected"),
    "sandbox": ("{{ ''.__class__.__mro__ }}", "SecurityError: access to attribute '__class__'"),
    "raise_exception": ("{{ raise_exception('Only user roles') }}", "raised 'Only user roles'"),
    "zero_division": ("{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_template_is_one_line_naming_its_file_before_training(tmp_path, name):
    source, why = BROKEN[name]
    tok = build_tokenizer(str(_folder(tmp_path, source)))
    with pytest.raises(ChatTemplateError) as e:
        ChatRenderer(tok)  # made with the data loader, before the model: no chat rendered yet
    msg = str(e.value)
    assert msg.startswith(f"model.tokenizer_path: the chat_template of {tmp_path}/tokenizer_config")
    assert why in msg and "\n" not in msg, msg
    assert msg.endswith(
        "fix it, or remove chat_template to render chats in the built-in Qwen format"
    )


def test_a_render_that_never_ends_is_stopped_at_the_time_limit():
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    template = ChatTemplate(loops + REPLY, {}, "/models/x/tokenizer_config.json")
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as e:
        TemplateRenderer(template, seconds=0.5)
    assert time.monotonic() - start < 5
    assert str(e.value).startswith(
        "model.tokenizer_path: the chat_template of /models/x/tokenizer_config.json took more "
        "than 0.5 s to render a sample conversation (tried before training) (an endless loop?)"
    )
    fine = TemplateRenderer(ChatTemplate(REPLY, {}, "t"), seconds=0.5)
    time.sleep(1)  # the timer is off between renders
    assert fine(CONV)[0].startswith("system: Be brief.<|im_end|>")


def test_a_template_that_fails_on_the_data_in_a_loader_worker_is_one_line(tmp_path):
    # Passes the sample (user, assistant), refuses the data's system message mid-run.
    refuses_system = (
        "{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        + REPLY
    )
    tok = build_tokenizer(str(_folder(tmp_path / "tok", refuses_system)))
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CONV}) + "\n")
    dl = loader(data, "chat", tokenizer=tok, num_workers=1, packing="padding", seq_len=64)
    with pytest.raises(ChatTemplateError) as e:
        next(iter(dl))
    assert str(e.value) == (
        f"model.tokenizer_path: the chat_template of {tmp_path}/tok/tokenizer_config.json fails "
        "on a conversation: the template raised 'no system role'; fix it, or remove "
        "chat_template to render chats in the built-in Qwen format"
    )
