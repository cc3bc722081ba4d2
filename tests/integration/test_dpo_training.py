"""DPO end to end on CPU, from tiny HF checkpoints (model.flavor = "auto"): FSDP2 x 2, CP x 2,
TP x 2, TP 2 x CP 2 and (LoRA, adapters-off reference) EP x 2 on gloo ranks train like one
process; a run stopped and resumed gives exactly the uninterrupted run's losses and rewards
(the reference copy and the loader state come from the checkpoint); the export holds the
policy; the memory estimate counts the reference copy."""

import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers import parallel_harness as harness
from tests.helpers.distributed import run_distributed
from tests.helpers.hf_model import make_hf
from torchtitan_ablate import train
from torchtitan_ablate.config import load_config
from torchtitan_ablate.estimator import estimate

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import convert_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow
TOKENIZER = str(ROOT / "assets/tokenizer/debug.tiktoken")
DATA = str(ROOT / "assets/preference/debug_preference.jsonl")
VOCAB = 2048  # covers the debug tokenizer
P = "--parallelism."
LORA = ["--lora.enable", "true", "--lora.rank", "4", "--lora.target_modules", "q_proj,experts"]


def dpo_args(hf_dir: Path) -> list[str]:
    return [
        "--model.flavor", "auto", "--model.tokenizer_path", TOKENIZER,
        "--model.moe_aux_loss_coef", "0",
        "--checkpoint.initial_load_path", str(hf_dir), "--checkpoint.initial_load_format", "hf",
        "--training.dataset", "preference", "--training.dataset_path", DATA,
        "--training.loss_chunk_size", "50", "--dpo.beta", "0.5", "--optimizer.lr", "1e-3",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    for kind in ("dense", "moe"):
        make_hf(kind, root / kind, vocab_size=VOCAB)
    return {kind: root / kind for kind in ("dense", "moe")}


CP2 = [P + "context_parallel_degree", "2"]
LAYOUTS = {  # name: (model, world size, extra args)
    "fsdp2": ("dense", 2, []),
    "hsdp2x1": ("dense", 2, [P + "data_parallel_replicate_degree", "2"]),
    "cp2": ("dense", 2, CP2),
    "tp2": ("dense", 2, [P + "tensor_parallel_degree", "2"]),
    "tp2_cp2": ("dense", 4, [P + "tensor_parallel_degree", "2", *CP2]),
    "ep2_lora": ("moe", 2, [P + "expert_parallel_degree", "2", *LORA]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_train_like_one_process(tmp_path, hf_dirs, layout):
    kind, world, extra = LAYOUTS[layout]
    args = dpo_args(hf_dirs[kind]) + (LORA if kind == "moe" else [])
    ref = run_distributed(harness.train_layout, 1, str(tmp_path / "one"), args)[0]
    got = run_distributed(harness.train_layout, world, str(tmp_path / layout), args + extra)[0]
    assert abs(ref["losses"][0] - 0.6931) < 1e-3  # step 1: policy == reference, loss = ln 2
    harness.assert_same_training(got, ref)


def _train(args: list[str]) -> list[dict]:
    return train.main(load_config(args))


def test_resume_is_exact_and_export_holds_the_policy(tmp_path, hf_dirs):
    common = ["--job.config_file", "train_configs/debug_model.toml", *dpo_args(hf_dirs["dense"])]
    common += ["--training.seq_len", "64", "--training.local_batch_size", "4"]
    common += ["--training.steps", "4", "--metrics.log_freq", "1", "--checkpoint.enable"]
    common += ["--lr_scheduler.warmup_steps", "1"]
    full = _train(common + ["--job.dump_folder", str(tmp_path / "full")])
    split = common + ["--job.dump_folder", str(tmp_path / "split")]
    first = _train(split + ["--training.exit_at_step", "2"])
    rest = _train(split)
    assert [r["step"] for r in first + rest] == [1, 2, 3, 4]
    for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        assert [r[key] for r in first + rest] == [r[key] for r in full], key
    assert full[0]["rewards/margins"] == 0  # step 1: the reference is the loaded policy
    out = tmp_path / "export"
    convert_checkpoint.main(["--to", "hf", str(tmp_path / "split/checkpoint/step-4"), str(out)])
    exported = load_file(out / "model.safetensors")
    initial = load_file(hf_dirs["dense"] / "model.safetensors")
    assert exported.keys() == initial.keys()
    moved = [k for k in initial if (exported[k] - initial[k]).abs().max() > 1e-4]
    assert len(moved) > len(initial) // 2  # the trained policy, not the reference


def test_estimate_counts_the_reference_copy():
    base = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "64"]
    base += ["--training.local_batch_size", "2", "--memory_estimation.world_size", "2"]
    dpo = ["--training.dataset", "preference", "--training.dataset_path", DATA]
    plain = estimate(load_config(base))["by_category"]
    copy = estimate(load_config(base + dpo))["by_category"]
    lora = estimate(load_config(base + dpo + ["--lora.enable", "true"]))["by_category"]
    assert copy["parameters"] == pytest.approx(2 * plain["parameters"], rel=0.02)
    assert lora["parameters"] < 1.2 * plain["parameters"]  # adapters off: no second copy
