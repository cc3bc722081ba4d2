"""Preference data for DPO: rendering (strings and TRL's conversational rows), response-only
labels, pairs kept whole in rows, bad rows (an error with the line, or skipped and counted),
exact resume."""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.data import assert_resumes_exactly
from torchtitan_ablate.components.data import IGNORE_INDEX, build_dataloader
from torchtitan_ablate.components.data.preference import PairRenderer
from torchtitan_ablate.components.data.sft import ChatRenderer
from torchtitan_ablate.components.text.tokenizer import build_tokenizer
from torchtitan_ablate.config import ConfigError
from torchtitan_ablate.config.job_config import Training

ROOT = Path(__file__).resolve().parents[4]
TOKENIZER = str(ROOT / "assets/tokenizer/debug.tiktoken")
DATA = str(ROOT / "assets/preference/debug_preference.jsonl")
TEXT_ROW = {"prompt": "Where is Oslo?", "chosen": " In Norway.", "rejected": " In Peru."}
CHAT_ROW = {
    "prompt": [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},  # a turn of the prompt: context only
        {"role": "user", "content": "Where is Oslo?"},
    ],
    "chosen": [{"role": "assistant", "content": "In Norway."}],
    "rejected": [{"role": "assistant", "content": "In Peru."}],
}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TOKENIZER)


def loader(tok, path: str, packing: str = "greedy", seq_len: int = 128, **kw):
    data = Training(
        dataset="preference", dataset_path=path, seq_len=seq_len, local_batch_size=2,
        packing=packing, seed=0,
    )  # fmt: skip
    return build_dataloader(data, tok, 0, 1, **kw)


def scored(tokens: list[int], mask: list[bool]) -> list[int]:
    return [t for t, m in zip(tokens, mask) if m]


def test_text_rows_score_the_response_and_eos(tok):
    tokens, mask, n = PairRenderer(tok, 128)(json.dumps(TEXT_ROW).encode())
    prompt = tok.encode(TEXT_ROW["prompt"])
    assert tokens[:n] == prompt + tok.encode(" In Norway.") + [tok.eos_id]
    assert tokens[n:] == prompt + tok.encode(" In Peru.") + [tok.eos_id]
    assert scored(tokens[:n], mask[:n]) == tok.encode(" In Norway.") + [tok.eos_id]
    assert scored(tokens[n:], mask[n:]) == tok.encode(" In Peru.") + [tok.eos_id]


def test_conversational_rows_render_as_sft_and_score_only_the_reply(tok):
    tokens, mask, n = PairRenderer(tok, 256)(json.dumps(CHAT_ROW).encode())
    full, _ = ChatRenderer(tok)(CHAT_ROW["prompt"] + CHAT_ROW["chosen"])
    assert tokens[:n] == full
    assert tok.decode(scored(tokens[:n], mask[:n])) == "In Norway.<|im_end|>"
    assert tok.decode(scored(tokens[n:], mask[n:])) == "In Peru.<|im_end|>"


@pytest.mark.parametrize("packing", ["greedy", "best_fit", "padding"])
def test_rows_hold_whole_pairs_as_document_pairs(tok, packing):
    """Documents 2k / 2k + 1 of every row are a chosen / rejected sequence of one pair, with
    labels only on response tokens; num_pairs counts them; positions restart per document."""
    render = PairRenderer(tok, 128)
    known = {}
    for line in Path(DATA).read_bytes().splitlines():
        tokens, mask, n = render(line)
        known[tuple(tokens[:n]), tuple(tokens[n:])] = (tokens, mask, n)
    batches = iter(loader(tok, DATA, packing))
    seen = 0
    for _ in range(6):
        batch = next(batches)
        for b in range(batch["input_ids"].shape[0]):
            ids, docs, labels = batch["input_ids"][b], batch["document_ids"][b], batch["labels"][b]
            n_pairs = int(batch["num_pairs"][b])
            assert n_pairs >= 1 and (packing != "padding" or n_pairs == 1)
            for k in range(n_pairs):
                chosen, rejected = (torch.nonzero(docs == d)[:, 0] for d in (2 * k, 2 * k + 1))
                tokens, mask, n = known[tuple(ids[chosen].tolist()), tuple(ids[rejected].tolist())]
                for where, part in ((chosen, slice(0, n)), (rejected, slice(n, None))):
                    t, m = tokens[part], mask[part]
                    want = [x if keep else IGNORE_INDEX for x, keep in zip(t[1:], m[1:])]
                    assert labels[where][:-1].tolist() == want
                    assert labels[where][-1] == IGNORE_INDEX
                    assert batch["positions"][b][where].tolist() == list(range(len(t)))
                seen += 1
            assert (labels[docs >= 2 * n_pairs] == IGNORE_INDEX).all()  # padding
    assert seen >= 12


def test_bad_rows_are_one_error_with_the_line_or_skipped_and_counted(tok, tmp_path, caplog):
    path = tmp_path / "pairs.jsonl"
    long = {"prompt": "word " * 200, "chosen": " a", "rejected": " b"}
    lines = [TEXT_ROW, {"prompt": "x", "chosen": "y"}, TEXT_ROW, {**TEXT_ROW, "chosen": ""},
             long, CHAT_ROW]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n{oops\n")
    with pytest.raises(ConfigError, match=r"pairs.jsonl:2: missing \['rejected'\].*max_bad_rows"):
        loader(tok, str(path))
    with pytest.raises(ConfigError, match="pairs.jsonl:5: the pair is .* longer than .* = 128"):
        loader(tok, str(path), max_bad_rows=2)
    caplog.set_level("WARNING", logger="torchtitan_ablate")
    batch = next(iter(loader(tok, str(path), packing="padding", max_bad_rows=4)))
    warning = caplog.records[-1].getMessage()
    assert "skipping 4 bad preference rows" in warning
    for where in (":2: missing", ":4: empty 'chosen'", ":5: the pair is", ":7: not a valid"):
        assert where in warning
    assert batch["num_pairs"].tolist() == [1, 1]  # rows 1 and 3: the good ones, in order
    assert torch.equal(batch["input_ids"][0], batch["input_ids"][1])


@pytest.mark.parametrize("packing", ["greedy", "padding"])
def test_resume_is_exact(tok, packing):
    assert_resumes_exactly(lambda: loader(tok, DATA, packing), skip=3, check=3)
