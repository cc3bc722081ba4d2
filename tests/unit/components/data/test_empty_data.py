"""Data without a document (an empty file, blank lines only) is one line when the loader is
built, i.e. before the model, not at the first step."""

import pytest

from tests.helpers.data import BYTE, loader
from torchtitan_ablate.components.data.errors import DatasetError
from torchtitan_ablate.components.text.tokenizer import build_tokenizer

QWEN_SPECIALS = build_tokenizer("assets/tokenizer/debug.tiktoken")  # chat needs <|im_start|>


@pytest.mark.parametrize(
    ("name", "content", "dataset"),
    [
        ("empty.jsonl", "", "text"),
        ("blank.txt", "\n  \n\n", "text"),
        ("empty_chat.jsonl", "", "chat"),
    ],
)
def test_data_without_a_document_fails_when_the_loader_is_built(tmp_path, name, content, dataset):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DatasetError) as e:
        tokenizer = QWEN_SPECIALS if dataset == "chat" else BYTE
        loader(path, dataset, tokenizer=tokenizer)  # built, not iterated
    assert str(e.value) == (
        f"training.dataset_path: {path} holds no documents (only blank lines); give a non-empty "
        "dataset"
    )


def test_an_empty_file_beside_others_is_fine(tmp_path):
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "b.jsonl").write_text('{"text": "hello"}\n')
    assert next(iter(loader(tmp_path)))["input_ids"].shape == (2, 16)
