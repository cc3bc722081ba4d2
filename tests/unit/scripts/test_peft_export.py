"""convert_checkpoint.py --to hf --peft: a LoRA fine-tune's adapters in PEFT's layout. Applied to
the HF base weights as PEFT does (W + (alpha / r) * B @ A) they give the merged export, and
peft.PeftModel (when installed) gives its logits; expert adapters are refused in one line. The
trainer's checkpoint.last_save_in_hf writes the same merged export."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from tests.helpers.distributed import run_distributed
from tests.helpers.hf_model import make_hf
from torchtitan_ablate import train
from torchtitan_ablate.config import load_config
from torchtitan_ablate.models.qwen3 import Qwen3StateDictAdapter, qwen3_flavors

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))
import convert_checkpoint  # noqa: E402

RANK, ALPHA, DROPOUT = 4, 8.0, 0.1
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
TOKENS = torch.randint(0, 2000, (2, 16), generator=torch.Generator().manual_seed(3))


def _train(args: list[str]) -> None:
    train.Trainer(load_config(args)).train()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> tuple[Path, Path]:
    """(HF base folder, DCP checkpoint of 3 LoRA steps on it): a tiny dense Qwen3 on CPU."""
    tmp = tmp_path_factory.mktemp("lora")
    make_hf("dense", tmp / "hf", vocab_size=2048)  # the debug tokenizer's vocabulary
    args = [
        "--job.dump_folder", str(tmp / "run"), "--model.flavor", "auto",
        "--model.tokenizer_path", str(ROOT / "assets/tokenizer/debug.tiktoken"),
        "--checkpoint.initial_load_path", str(tmp / "hf"),
        "--checkpoint.initial_load_format", "hf",
        "--checkpoint.enable", "true", "--checkpoint.interval", "3",
        "--checkpoint.last_save_in_hf", "true",
        "--training.dataset", "chat", "--training.dataset_path",
        str(ROOT / "assets/sft/debug_chat.jsonl"),
        "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.steps", "3",
        "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "1",
        "--lora.enable", "true", "--lora.rank", str(RANK), "--lora.alpha", str(ALPHA),
        "--lora.dropout", str(DROPOUT), "--lora.target_modules", ",".join(TARGETS),
    ]  # fmt: skip
    run_distributed(_train, 1, args)
    return tmp / "hf", tmp / "run/checkpoint/step-3"


@pytest.fixture(scope="module")
def exported(lora_run, tmp_path_factory) -> tuple[Path, Path]:
    """(merged HF folder, PEFT folder) written by one call."""
    out = tmp_path_factory.mktemp("export")
    convert_checkpoint.main(["--to", "hf", str(lora_run[1]), str(out / "merged"),
                             "--peft", str(out / "peft")])  # fmt: skip
    return out / "merged", out / "peft"


def test_the_trainers_last_save_in_hf_is_the_merged_export(lora_run, exported):
    # checkpoint.last_save_in_hf wrote step-3/hf with the same export: adapters merged.
    merged, hf = exported[0], lora_run[1] / "hf"
    names = sorted(p.name for p in merged.iterdir())
    assert names == sorted(p.name for p in hf.iterdir()) and "model.safetensors" in names
    assert all((hf / n).read_bytes() == (merged / n).read_bytes() for n in names)
    assert not any("lora" in k for k in load_file(hf / "model.safetensors"))


def test_peft_keys_shapes_and_config(lora_run, exported):
    config = json.loads((exported[1] / "adapter_config.json").read_text())
    assert config == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA,
        "lora_dropout": DROPOUT, "target_modules": sorted(TARGETS), "bias": "none",
        "base_model_name_or_path": str(lora_run[0]), "inference_mode": True,
        "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None,
    }  # fmt: skip
    adapters = load_file(exported[1] / "adapter_model.safetensors")
    base = load_file(lora_run[0] / "model.safetensors")
    modules = {"q_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
    expected = {}
    for layer in range(2):
        for name, parent in modules.items():
            out_features, in_features = base[f"model.layers.{layer}.{parent}.{name}.weight"].shape
            key = f"base_model.model.model.layers.{layer}.{parent}.{name}"
            expected[f"{key}.lora_A.weight"] = (RANK, in_features)
            expected[f"{key}.lora_B.weight"] = (out_features, RANK)
    assert {k: tuple(v.shape) for k, v in adapters.items()} == expected


def test_peft_applied_to_the_base_equals_the_merged_export(lora_run, exported):
    base = load_file(lora_run[0] / "model.safetensors")
    merged = load_file(exported[0] / "model.safetensors")
    adapters = load_file(exported[1] / "adapter_model.safetensors")
    applied = dict(base)
    for key_a, a in adapters.items():
        if ".lora_A." not in key_a:
            continue
        b = adapters[key_a.replace(".lora_A.", ".lora_B.")]
        weight = key_a.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        applied[weight] = base[weight] + (ALPHA / RANK) * (b @ a)
        assert (applied[weight] - base[weight]).abs().max() > 1e-4  # training moved B from 0
    assert applied.keys() == merged.keys()
    for key in merged:
        torch.testing.assert_close(applied[key], merged[key], atol=1e-6, rtol=0)


def test_peft_model_logits_equal_the_merged_export(lora_run, exported):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    load = dict(attn_implementation="eager")
    base = AutoModelForCausalLM.from_pretrained(lora_run[0], **load)
    with_adapters = peft.PeftModel.from_pretrained(base, exported[1]).eval()
    merged = AutoModelForCausalLM.from_pretrained(exported[0], **load).eval()
    with torch.no_grad():
        want, got = merged(TOKENS).logits, with_adapters(TOKENS).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _fails(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        convert_checkpoint.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_expert_adapters_and_no_adapters_are_refused(tmp_path, capsys):
    for flavor, experts in [("debugmodel_moe", True), ("debugmodel", False)]:
        args = qwen3_flavors[flavor]
        state = {k: torch.zeros(s) for k, s in Qwen3StateDictAdapter(args).native_shapes().items()}
        if experts:
            _, out_features, in_features = state["layers.0.moe.experts.w1"].shape
            state["layers.0.moe.experts.lora_a_w1"] = torch.zeros(args.num_experts, 2, in_features)
            state["layers.0.moe.experts.lora_b_w1"] = torch.zeros(args.num_experts, out_features, 2)
        ckpt = tmp_path / flavor / "step-1"
        dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
        capsys.readouterr()  # DCP's one-process warning, when warnings reach stderr
        argv = ["--to", "hf", str(ckpt), str(tmp_path / flavor / "hf"), "--flavor", flavor,
                "--lora_alpha", "4", "--peft", str(tmp_path / flavor / "peft")]  # fmt: skip
        err = _fails(argv, capsys)
        assert len(err.strip().splitlines()) == 1, err
        assert ("no PEFT layout for Qwen3-MoE" if experts else "holds no LoRA adapters") in err
        assert sorted(p.name for p in (tmp_path / flavor).iterdir()) == ["step-1"]  # nothing


def test_peft_needs_to_hf_and_its_own_folder(tmp_path, capsys):
    out = str(tmp_path / "o")
    for argv in (["--to", "dcp", "x", out, "--peft", str(tmp_path / "p")],
                 ["--to", "hf", "x", out, "--peft", out]):  # fmt: skip
        assert "--peft PEFT_DIR needs --to hf" in _fails(argv, capsys)
