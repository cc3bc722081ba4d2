"""Chat SFT data: Qwen chat rendering, assistant-only labels, packing modes, exact resume."""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.data import CONV, assert_resumes_exactly
from torchtitan_ablate.components.data import IGNORE_INDEX, build_dataloader
from torchtitan_ablate.components.data.sft import ChatRenderer, special_token_id
from torchtitan_ablate.components.text.tokenizer import build_tokenizer
from torchtitan_ablate.config import ConfigError, load_config
from torchtitan_ablate.config.job_config import Training

ROOT = Path(__file__).resolve().parents[4]
TOKENIZER = str(ROOT / "assets/tokenizer/debug.tiktoken")
CHAT = str(ROOT / "assets/sft/debug_chat.jsonl")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TOKENIZER)


def loader(tok, packing: str, seq_len: int = 96, batch: int = 2, path: str = CHAT, **kw):
    data = Training(
        dataset="chat", dataset_path=path, seq_len=seq_len, local_batch_size=batch,
        packing=packing, seed=0,
    )  # fmt: skip
    return build_dataloader(data, tok, kw.get("dp_rank", 0), kw.get("dp", 1))


def test_render_is_qwen_chat_format_and_masks_all_but_assistant_replies(tok):
    tokens, mask = ChatRenderer(tok)(CONV)
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONV)
    assert tok.decode(tokens) == expected
    im_end = special_token_id(tok, "<|im_end|>")
    trained = [t for t, m in zip(tokens, mask) if m]
    replies = [tok.encode(m["content"]) + [im_end] for m in CONV if m["role"] == "assistant"]
    assert trained == sum(replies, [])
    assert tok.decode(trained) == "It is 4.<|im_end|>It is 6.<|im_end|>"


@pytest.mark.parametrize("packing", ["greedy", "best_fit", "padding"])
def test_labels_only_on_assistant_tokens_and_conversations_kept_whole(tok, packing):
    """Every document of every row is one whole conversation whose labels are exactly its next
    assistant tokens (counted against the rendering); nothing else carries a label."""
    render = ChatRenderer(tok)
    expected = {}  # rendered text -> labels it must carry
    for line in Path(CHAT).read_text().splitlines():
        tokens, mask = render(json.loads(line)["messages"])
        expected[tok.decode(tokens)] = [
            t if m else IGNORE_INDEX for t, m in zip(tokens[1:], mask[1:])
        ]
    it = iter(loader(tok, packing, seq_len=256, batch=1))
    n_docs = 0
    for _ in range(12):
        b = {k: v[0] for k, v in next(it).items()}
        for d in b["document_ids"].unique().tolist():
            where = torch.nonzero(b["document_ids"] == d).flatten()
            ids, labels = b["input_ids"][where], b["labels"][where]
            assert (b["positions"][where] == torch.arange(len(where))).all()
            text = tok.decode(ids.tolist())
            if text not in expected:  # the padding tail
                assert (ids == tok.pad_id).all() and (labels == IGNORE_INDEX).all()
                continue
            assert labels.tolist() == expected[text] + [IGNORE_INDEX]  # last: doc boundary
            n_docs += 1
    assert n_docs >= 12
    if packing != "padding":
        assert n_docs > 12  # several conversations per row


def test_best_fit_pads_no_more_than_greedy(tok):
    pads = {}
    for packing in ("greedy", "best_fit"):
        it = iter(loader(tok, packing, seq_len=128, batch=4))
        rows = [next(it) for _ in range(4)]
        pads[packing] = sum(int((r["input_ids"] == tok.pad_id).sum()) for r in rows)
    assert pads["best_fit"] <= pads["greedy"]


@pytest.mark.parametrize("packing", ["greedy", "best_fit"])
def test_resume_is_exact(tok, packing):
    assert_resumes_exactly(lambda: loader(tok, packing), skip=3, check=4)


def test_dp_ranks_read_disjoint_conversations(tok):
    firsts = [next(iter(loader(tok, "padding", batch=1, dp_rank=r, dp=2))) for r in (0, 1)]
    assert not torch.equal(firsts[0]["input_ids"], firsts[1]["input_ids"])


def test_clear_errors(tok, tmp_path):
    with pytest.raises(ConfigError, match="model.tokenizer_path: .* no special token <|im_start"):
        loader(build_tokenizer("byte"), "greedy")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user"}]}\n')
    with pytest.raises(ConfigError, match="training.dataset_path: .*bad.jsonl:1: expected"):
        next(iter(loader(tok, "greedy", path=str(bad))))
    bad.write_text("{oops\n")
    with pytest.raises(ConfigError, match="training.dataset_path: .*bad.jsonl:1: not a valid"):
        next(iter(loader(tok, "greedy", path=str(bad))))
    with pytest.raises(ConfigError, match="training.packing = 'best_fit'"):
        load_config(["--training.packing", "best_fit"])  # the rule's one home: the loader


SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


def test_sharegpt_and_alpaca_rows_give_the_rows_of_their_messages(tok, tmp_path):
    """A ShareGPT line and an Alpaca line are loaded exactly as the messages they stand for:
    same tokens, same assistant-only labels, in one file with a messages line."""
    sharegpt = {"conversations": [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]}
                                  for m in CONV]}  # fmt: skip
    alpaca = {"instruction": "Add them.", "input": "2 and 2", "output": "4"}
    alpaca_no_input = {"instruction": "Say hi.", "input": "", "output": "hi"}
    as_messages = [
        CONV,
        [{"role": "user", "content": "Add them.\n\n2 and 2"},
         {"role": "assistant", "content": "4"}],
        [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}],
    ]  # fmt: skip
    mixed, plain = tmp_path / "mixed.jsonl", tmp_path / "plain.jsonl"
    mixed.write_text("".join(json.dumps(r) + "\n" for r in (sharegpt, alpaca, alpaca_no_input)))
    plain.write_text("".join(json.dumps({"messages": m}) + "\n" for m in as_messages))
    got, want = (next(iter(loader(tok, "padding", batch=3, path=str(p))))
                 for p in (mixed, plain))  # fmt: skip
    for key in want:
        assert torch.equal(got[key], want[key]), key
    render = ChatRenderer(tok)
    tokens, mask = render(as_messages[1])
    assert tok.decode(tokens).startswith("<|im_start|>user\nAdd them.\n\n2 and 2<|im_end|>")
    assert tok.decode([t for t, m in zip(tokens, mask) if m]) == "4<|im_end|>"


@pytest.mark.parametrize(
    "row",
    [
        {"conversations": [{"from": "bot", "value": "hi"}]},  # an unknown speaker
        {"conversations": []},
        {"instruction": "Say hi.", "input": 3, "output": "hi"},
        {"instruction": "Say hi."},  # no output
        {"prompt": "hi", "completion": "yo"},
    ],
)
def test_a_row_in_no_layout_is_one_line_naming_file_and_line(tok, tmp_path, row):
    path = tmp_path / "chats.jsonl"
    good = {"instruction": "Say hi.", "output": "hi"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError) as e:
        next(iter(loader(tok, "greedy", path=str(path))))
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f'training.dataset_path: {path}:2: expected {{"messages"')
    assert "ShareGPT" in message and "Alpaca" in message
