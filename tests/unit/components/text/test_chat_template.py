"""SFT with the tokenizer folder's own chat_template: the text and ids are transformers'
apply_chat_template output, and only the assistant replies (through <|im_end|>) are trained."""

import json
from pathlib import Path

import pytest

from tests.helpers.data import CONV
from tests.helpers.hf_tokenizer import make_hf_tokenizer_json
from torchtitan_ablate.components.data.sft import ChatRenderer
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
    """A tiny Qwen-layout tokenizer.json with the chat specials, and its tokenizer_config.json."""
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
    texts = [m["content"] for m in CONV] * 20
    make_hf_tokenizer_json(tmp_path / "tokenizer.json", specials, texts)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}
    if template is not None:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


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
    with pytest.raises(ConfigError, match="assistant message 2 differently"):
        ChatRenderer(tok)(CONV)
