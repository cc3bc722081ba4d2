"""A small Qwen-layout BPE tokenizer.json (the Hugging Face `tokenizers` format) on disk."""

import json
from pathlib import Path

import pytest

from torchtitan_ablate.components.text.tokenizer import QWEN_PATTERN

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog 12345.",
    "  leading spaces,\nnew lines\n\nand unicode: cafe\u0301 \u00fcber \u4e2d\u6587 \U0001f600",
    "",
]


def make_hf_tokenizer_json(
    path: Path,
    special_tokens: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>"),
    texts: list[str] | None = None,
) -> "object":
    """A small Qwen-layout BPE tokenizer.json trained on `texts` (default: TEXTS)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE())
    # Qwen's layout: a regex Split, then ByteLevel without its own regex.
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if texts is None:
        texts = TEXTS * 20 + ["the lazy dog sleeps in the sun"] * 20
    hf.train_from_iterator(texts, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    hf.save(str(path))
    return hf


CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")


def make_chat_tokenizer_folder(folder: Path, template: object, texts: list[str]) -> Path:
    """A tiny Qwen-layout tokenizer.json with the chat specials, trained on `texts`, and its
    tokenizer_config.json with `template` as chat_template (None: no template)."""
    make_hf_tokenizer_json(folder / "tokenizer.json", CHAT_SPECIALS, texts)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
