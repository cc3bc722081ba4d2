"""KV-cache decoding (models/qwen3/generate.py) and scripts/generate.py on tiny random models:
greedy output equals re-running the training forward per token and transformers' `generate` on
the same weights, sampling is seeded and stays in the nucleus, and the script samples from a
training checkpoint end to end, also as a chat (--chat)."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM

from torchtitan_ablate.components.checkpoint.hf import save_hf_checkpoint
from torchtitan_ablate.components.data.sft import ChatRenderer
from torchtitan_ablate.components.text.tokenizer import build_tokenizer
from torchtitan_ablate.config import load_config, to_toml
from torchtitan_ablate.models.qwen3 import Qwen3Model, qwen3_flavors
from torchtitan_ablate.models.qwen3.generate import generate, sample_next

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))
import generate as generate_script  # noqa: E402

TOKENIZER = str(ROOT / "assets/tokenizer/debug.tiktoken")
FLAVORS = ["debugmodel", "debugmodel_moe"]
N_NEW = 24


def random_model(flavor: str, **changes) -> Qwen3Model:
    """fp32 model with weights large enough that greedy picks are far from ties (the 0.02 init
    gives near-zero logits and a model that repeats one token); `changes` to its sizes."""
    torch.manual_seed(0)
    model = Qwen3Model(dataclasses.replace(qwen3_flavors[flavor], **changes))
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model.eval()


def prompt(batch: int = 2, length: int = 7) -> torch.Tensor:
    return torch.randint(0, 2000, (batch, length), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def greedy_full_forward(model: Qwen3Model, prompt_BL: torch.Tensor, n: int) -> torch.Tensor:
    """The reference: the training forward over the whole sequence for every new token."""
    tokens_BS = prompt_BL
    for _ in range(n):
        next_B1 = model(tokens_BS)[:, -1].argmax(dim=-1, keepdim=True)
        tokens_BS = torch.cat([tokens_BS, next_B1], dim=1)
    return tokens_BS[:, prompt_BL.shape[1] :]


@pytest.mark.parametrize("flavor", FLAVORS)
def test_cached_greedy_equals_full_forward(flavor):
    model = random_model(flavor)
    got = generate(model, prompt(), N_NEW)
    assert got.shape == (2, N_NEW)
    assert got[0].unique().numel() > N_NEW // 2  # a varied continuation, not one token repeated
    torch.testing.assert_close(got, greedy_full_forward(model, prompt(), N_NEW), atol=0, rtol=0)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_greedy_equals_transformers_generate(flavor, tmp_path):
    model = random_model(flavor)
    save_hf_checkpoint(model.state_dict(), model.args, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        out = hf.generate(
            prompt(), do_sample=False, max_new_tokens=N_NEW, eos_token_id=None, pad_token_id=0
        )
    expected = out[:, prompt().shape[1] :]
    assert expected.shape == (2, N_NEW)
    torch.testing.assert_close(generate(model, prompt(), N_NEW), expected, atol=0, rtol=0)
    # The script's HF-folder path reads the same export back.
    loaded, job = generate_script.load_model(tmp_path, None, torch.device("cpu"))
    assert job is None
    torch.testing.assert_close(generate(loaded, prompt(), N_NEW), expected, atol=0, rtol=0)


def test_sampling_is_seeded_and_stops_at_eos():
    model = random_model("debugmodel")
    draw = dict(temperature=1.0, top_p=0.9)
    first = generate(model, prompt(), N_NEW, seed=3, **draw)
    torch.testing.assert_close(generate(model, prompt(), N_NEW, seed=3, **draw), first)
    assert not torch.equal(generate(model, prompt(), N_NEW, seed=4, **draw), first)
    # A nucleus this small holds only the most likely token: greedy.
    greedy = generate(model, prompt(), N_NEW)
    tiny_nucleus = generate(model, prompt(), N_NEW, temperature=1.0, top_p=1e-6)
    torch.testing.assert_close(tiny_nucleus, greedy)
    # eos: a row that produced it is padded with it until every row has (or N_NEW is reached).
    eos = int(greedy[0, 5])
    stop = greedy[0].tolist().index(eos) + 1
    got = generate(model, prompt(), N_NEW, eos_id=eos)
    assert got.shape[1] >= stop and (got[0, stop:] == eos).all()
    torch.testing.assert_close(got[0, :stop], greedy[0, :stop])


def test_top_p_keeps_the_nucleus():
    probs_V = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits_BV = probs_V.log().expand(4000, 4)
    gen = torch.Generator().manual_seed(0)
    drawn = sample_next(logits_BV, temperature=1.0, top_p=0.7, generator=gen)
    counts = torch.bincount(drawn, minlength=4)
    assert counts[2:].sum() == 0  # 0.5 + 0.3 reach 0.7: the rest is cut
    assert abs(counts[0] / counts[:2].sum() - 0.5 / 0.8) < 0.05  # renormalised within it
    torch.testing.assert_close(sample_next(logits_BV[:2]), torch.zeros(2, dtype=torch.long))


def write_training_run(dump: Path, model: Qwen3Model, flavor: str) -> Path:
    """A dump folder as training leaves it: config.toml and a full checkpoint/step-1 (model,
    optimizer entries and the step; generation must read the model entries only)."""
    config = load_config(["--model.flavor", flavor, "--model.tokenizer_path", TOKENIZER])
    dump.mkdir(parents=True)
    (dump / "config.toml").write_text(to_toml(config))
    state = dict(model.state_dict())
    for key in list(state):
        state[f"optimizer.state.{key}.exp_avg"] = torch.zeros_like(state[key])
    state["step"] = 1
    step_dir = dump / "checkpoint" / "step-1"
    dcp.save(state, checkpoint_id=str(step_dir), no_dist=True)
    return step_dir


def test_script_samples_a_training_checkpoint(tmp_path):
    model = random_model("debugmodel_moe")
    step_dir = write_training_run(tmp_path / "run", model, "debugmodel_moe")
    text = "Noah lives in Madrid"
    cmd = [sys.executable, str(ROOT / "scripts/generate.py"), str(step_dir), "--prompt", text]
    result = subprocess.run(
        [*cmd, "--max-new-tokens", "12"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    tok = build_tokenizer(TOKENIZER)
    ids = tok.encode(text)
    new = generate(model, torch.tensor([ids]), 12, eos_id=tok.eos_id)[0].tolist()
    new = new[: new.index(tok.eos_id)] if tok.eos_id in new else new
    assert result.stdout == tok.decode(ids + new) + "\n"
    assert result.stdout.startswith(text)
    assert "tokens/s" in result.stderr


def test_script_missing_checkpoint_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        generate_script.main([str(tmp_path / "nope"), "--prompt", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert "nope: no such folder" in err[0]


def test_chat_replies_with_the_template_and_stops_at_the_end_of_turn(tmp_path, capsys):
    """--chat: the prompt is a user message rendered as SFT renders chats, with the assistant
    turn opened; the reply stops at <|im_end|> and is printed alone."""
    tok = build_tokenizer(TOKENIZER)
    render = ChatRenderer(tok)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt_ids = render.generation_prompt(messages)
    assert tok.decode(prompt_ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Untied, so that the end of turn's output row can change alone: a scaled copy of the row
    # of the token greedy picks 4th makes it the greedy pick by then.
    model = random_model("debugmodel", tie_embeddings=False)
    fourth = int(generate(model, torch.tensor([prompt_ids]), 4)[0, 3])
    with torch.no_grad():
        model.output.weight[render.im_end] = 1.5 * model.output.weight[fourth]
    greedy = generate(model, torch.tensor([prompt_ids]), 12)[0].tolist()
    assert render.im_end in greedy[:4]
    stop = greedy.index(render.im_end)
    save_hf_checkpoint(model.state_dict(), model.args, tmp_path)
    args = [str(tmp_path), "--tokenizer", TOKENIZER, "--chat", "--system", "Be brief."]
    args += ["--prompt", "Hi!"]
    text = generate_script.main([*args, "--max-new-tokens", "12"])
    out, err = capsys.readouterr()
    assert text == tok.decode(greedy[:stop]) and out == text + "\n"
    assert f"{stop + 1} tokens in" in err  # generation ended at the end of turn, not at 12


def test_interactive_chat_keeps_the_history():
    seen = []

    def answer(messages: list) -> str:
        seen.append([m["content"] for m in messages])
        return f"reply {len(seen)}"

    last = generate_script.converse(answer, [], ["first\n", "\n", "second\n"])
    assert last == "reply 2"
    assert seen == [["first"], ["first", "reply 1", "second"]]


def test_chat_options_need_each_other(capsys):
    with pytest.raises(SystemExit):
        generate_script.parse_args(["ckpt", "--prompt", "hi", "--system", "Be brief."])
    assert "--system is a chat message: add --chat" in capsys.readouterr().err
