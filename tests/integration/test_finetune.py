"""Fine-tuning end to end on CPU: tiny random HF checkpoints (made here with transformers) load
with model.flavor = "auto", fine-tune on chat data with assistant-only labels, export with
scripts/convert_checkpoint.py, and transformers reads the export with equal logits. LoRA: the
base stays frozen, and FSDP2 x 2 / EP x 2 (also reading the HF weights sharded) train like one
process."""

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import parallel_harness as harness
from tests.helpers.distributed import run_distributed
from tests.helpers.hf_model import make_hf
from torchtitan_ablate import build, train
from torchtitan_ablate.components.data.packing import IGNORE_INDEX
from torchtitan_ablate.components.data.sft import ChatRenderer
from torchtitan_ablate.components.text.tokenizer import build_tokenizer
from torchtitan_ablate.config import load_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import convert_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow
TOKENIZER = str(ROOT / "assets/tokenizer/debug.tiktoken")
CHAT = str(ROOT / "assets/sft/debug_chat.jsonl")
VOCAB = 2048  # covers the debug tokenizer
TOKENS = torch.randint(0, 2000, (2, 24), generator=torch.Generator().manual_seed(5))


def sft_args(hf_dir: Path, dump: Path, steps: int) -> list[str]:
    return [
        "--job.dump_folder", str(dump), "--model.flavor", "auto",
        "--model.tokenizer_path", TOKENIZER, "--model.moe_aux_loss_coef", "0",
        "--checkpoint.initial_load_path", str(hf_dir), "--checkpoint.initial_load_format", "hf",
        "--checkpoint.enable", "true", "--checkpoint.interval", str(steps),
        "--training.dataset", "chat", "--training.dataset_path", CHAT,
        "--training.packing", "best_fit", "--training.seq_len", "64",
        "--training.local_batch_size", "2", "--training.steps", str(steps),
        "--optimizer.lr", "1e-3", "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
    ]  # fmt: skip


def _finetune(args: list[str]) -> dict:
    """One process: loads, saves the loaded weights as step 0, trains, returns what it saw."""
    trainer = train.Trainer(load_config(args))
    trainer.checkpointer.load()
    with torch.no_grad():
        logits_before = trainer.model.eval()(TOKENS)
    trainer.model.train()
    trainer.checkpointer.save(0, force=True)
    seen = []
    next_batches = trainer.next_batches

    def recording(data_iter):
        batches, t = next_batches(data_iter)
        seen.extend(b["input_ids"].clone() for b in batches)
        seen.extend(b["labels"].clone() for b in batches)
        seen.extend(b["document_ids"].clone() for b in batches)
        return batches, t

    trainer.next_batches = recording
    records = trainer.train()
    with torch.no_grad():
        logits_after = trainer.model.eval()(TOKENS)
    return {
        "losses": [r["loss"] for r in records],
        "before": logits_before,
        "after": logits_after,
        "batches": [seen[i : i + 3] for i in range(0, len(seen), 3)],
    }


def expected_labels() -> dict[str, list[int]]:
    """Rendered conversation -> the labels it must carry (next token if it is an assistant's)."""
    tok, out = build_tokenizer(TOKENIZER), {}
    render = ChatRenderer(tok)
    for line in Path(CHAT).read_text().splitlines():
        tokens, mask = render(json.loads(line)["messages"])
        labels = [t if m else IGNORE_INDEX for t, m in zip(tokens[1:], mask[1:])]
        out[tok.decode(tokens)] = labels + [IGNORE_INDEX]
    return out


def export_logits(dcp_dir: Path, out: Path) -> torch.Tensor:
    convert_checkpoint.main(["--to", "hf", str(dcp_dir), str(out)])
    hf = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(TOKENS).logits


EXPERT_LORA = [
    "--lora.enable",
    "true",
    "--lora.rank",
    "4",
    "--lora.target_modules",
    "q_proj,experts",
]


@pytest.mark.parametrize(
    "kind, extra", [("dense_tied", []), ("moe", []), ("moe", EXPERT_LORA)],
    ids=["dense_tied", "moe", "moe_lora_experts"],
)  # fmt: skip
def test_hf_finetune_export(tmp_path, kind, extra):
    # With LoRA the export merges the adapters (expert ones too) into the base weights.
    hf = make_hf(kind, tmp_path / "hf", vocab_size=VOCAB)
    with torch.no_grad():
        hf_logits = hf(TOKENS).logits
    dump = tmp_path / "run"
    out = run_distributed(_finetune, 1, sft_args(tmp_path / "hf", dump, 10) + extra)[0]
    torch.testing.assert_close(out["before"], hf_logits, atol=1e-5, rtol=1e-5)
    assert len(out["losses"]) == 10 and all(x == x for x in out["losses"])  # finite

    # Loss only on assistant tokens: every label position is counted against the rendering.
    tok, expected, n_labels = build_tokenizer(TOKENIZER), expected_labels(), 0
    for ids_BS, labels_BS, docs_BS in out["batches"]:
        for ids, labels, docs in zip(ids_BS, labels_BS, docs_BS):
            for d in docs.unique().tolist():
                where = docs == d
                n, text = int(where.sum()), tok.decode(ids[where].tolist())
                if (ids[where] == tok.pad_id).all():  # the padding tail
                    assert (labels[where] == IGNORE_INDEX).all()
                    continue
                # a whole conversation, or the start of one cut at seq_len
                full = next(k for k in expected if k.startswith(text))
                assert labels[where].tolist() == expected[full][: n - 1] + [IGNORE_INDEX]
            n_labels += int((labels != IGNORE_INDEX).sum())
    assert n_labels > 0

    # HF -> ours -> 0 steps -> HF, and after 10 steps: transformers gives our logits.
    ckpt = dump / "checkpoint"
    torch.testing.assert_close(export_logits(ckpt / "step-0", tmp_path / "hf0"), hf_logits)
    trained = export_logits(ckpt / "step-10", tmp_path / "hf10")
    torch.testing.assert_close(trained, out["after"], atol=1e-5, rtol=1e-5)
    assert (trained - hf_logits).abs().max() > 1e-3  # training changed the model


def test_convert_hf_to_dcp_and_back(tmp_path):
    hf = make_hf("moe", tmp_path / "hf", vocab_size=96)
    tokens = TOKENS % 96
    convert_checkpoint.main(["--to", "dcp", str(tmp_path / "hf"), str(tmp_path / "dcp")])
    convert_checkpoint.main(["--to", "hf", str(tmp_path / "dcp"), str(tmp_path / "back")])
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(tokens).logits, hf(tokens).logits)


# ---- LoRA: frozen base, layouts equal ---------------------------------------------------------


def _lora_layout(dump: str, args: list[str]) -> dict:
    """parallel_harness.train_layout plus the full parameters before training (rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    build.build_dataloader = harness._build_global_slicing_loader
    trainer = train.Trainer(load_config(harness.BASE + ["--job.dump_folder", dump] + args))
    trainer.dataloader.batches_done = lambda: trainer.step * trainer.grad_accum
    trainer.checkpointer.load()
    before = {k: v.clone() for k, v in get_model_state_dict(trainer.model, options=full).items()}
    records = trainer.train()
    after = get_model_state_dict(trainer.model, options=full)
    rank0 = torch.distributed.get_rank() == 0
    return {
        "losses": [r["loss"] for r in records],
        "params": {k: v.clone() for k, v in after.items()} if rank0 else None,
        "before": before if rank0 else None,
        "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
    }


LORA = ["--lora.enable", "true", "--lora.rank", "4", "--lora.alpha", "8"]
LORA_LAYOUTS = {
    "dense_fsdp2": ("dense", ["--lora.target_modules", "q_proj,v_proj,o_proj,gate_proj,down_proj"],
                    ["--parallelism.data_parallel_shard_degree", "2"]),
    "moe_ep2": ("moe", ["--lora.target_modules", "q_proj,k_proj,experts"],
                ["--parallelism.expert_parallel_degree", "2"]),
    "moe_ep2_tokens": ("moe", ["--lora.target_modules", "q_proj,k_proj,experts"],
                       ["--parallelism.expert_parallel_degree", "2",
                        "--parallelism.expert_parallel_dispatch", "tokens"]),
}  # fmt: skip


@pytest.mark.parametrize("layout", list(LORA_LAYOUTS))
def test_lora_frozen_base_and_layouts_match(tmp_path, layout):
    kind, targets, parallel = LORA_LAYOUTS[layout]
    make_hf(kind, tmp_path / "hf", vocab_size=VOCAB)
    args = sft_args(tmp_path / "hf", tmp_path / "unused", 5)
    args = args[2:] + ["--checkpoint.enable", "false", "--training.packing", "greedy"]
    args += LORA + targets
    ref = run_distributed(_lora_layout, 1, str(tmp_path / "ref"), args)[0]
    got = run_distributed(_lora_layout, 2, str(tmp_path / "par"), args + parallel)[0]

    changed = {k for k in ref["params"] if not torch.equal(ref["params"][k], ref["before"][k])}
    assert changed and all(".lora_" in k for k in changed)  # base frozen, adapters trained
    assert {k for k in ref["params"] if ".lora_b" in k} <= changed  # B moved away from 0
    n_adapters = sum(v.numel() for k, v in ref["params"].items() if ".lora_" in k)
    assert ref["trainable"] == n_adapters
    for k in ref["before"]:  # the sharded HF read gave exactly the one-process weights
        torch.testing.assert_close(got["before"][k], ref["before"][k], atol=0, rtol=0)
    harness.assert_same_training(got, ref)
