"""Initial weights are bitwise identical in every layout (gloo ranks, the build path): one
process, FSDP 2 and 4, HSDP 2x2, CP 2 and CP 2 x FSDP 2, EP 2, EP 4 and EP 2 with FSDP over the
experts, with activation checkpointing and compile wrappers, for a tied dense and an untied MoE
model. The vocabulary (2051) makes FSDP's shards uneven. LoRA and float8 keep the base weights;
LoRA's adapters are the same on one and two ranks."""

import dataclasses
import importlib.util

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from tests.helpers.distributed import run_distributed
from torchtitan_ablate import build
from torchtitan_ablate.config import load_config

pytestmark = pytest.mark.slow  # multi-process

BASE = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "64"]
BASE += ["--model.vocab_size", "2051"]
MODELS = {"dense_tied": ("debugmodel", True), "moe_untied": ("debugmodel_moe", False)}
P = "--parallelism."
WRAPPED = ["--activation_checkpoint.mode", "full", "--compile.enable"]
EP2, EP4 = [P + "expert_parallel_degree", "2"], [P + "expert_parallel_degree", "4"]
CP2 = [P + "context_parallel_degree", "2"]
FLOAT8 = ["--float8.enable"] if importlib.util.find_spec("torchao") else None
FLOAT8_GATHER = FLOAT8 and FLOAT8 + ["--float8.enable_fsdp_float8_all_gather"]
LAYOUTS = {
    1: {"one_process": [], "ac_compile": WRAPPED, "lora": ["--lora.enable"], "float8": FLOAT8},
    2: {
        "fsdp2": [],
        "fsdp2_ac_compile": WRAPPED,
        "fsdp2_lora": ["--lora.enable"],
        "fsdp2_float8_gather": FLOAT8_GATHER,
        "cp2": CP2,
    },
    4: {"fsdp4": [], "hsdp2x2": [P + "data_parallel_replicate_degree", "2"], "cp2_fsdp2": CP2},
}
MOE_LAYOUTS = {2: {"ep2": EP2}, 4: {"ep2_efsdp2": EP2, "ep4": EP4}}


def _initial_weights(layouts: dict[str, list[str] | None], moe_layouts: dict) -> dict | None:
    """On every rank: each (model, layout) built by build_model; rank 0 returns full tensors."""
    out = {}
    cases = [(m, n, a) for m in MODELS for n, a in layouts.items() if a is not None]
    cases += [("moe_untied", n, a) for n, a in moe_layouts.items()]
    for model_name, layout_name, args in cases:
        flavor, tied = MODELS[model_name]
        config = load_config(BASE + ["--model.flavor", flavor] + args)
        layout = build.build_layout(config, dist.get_world_size(), "cpu")
        model_args = dataclasses.replace(layout.model_args, tie_embeddings=tied)
        [model], _ = build.build_model(
            config, layout.parallel_dims, model_args, torch.device("cpu")
        )
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        if dist.get_rank() == 0:
            out[model_name, layout_name] = {k: v.detach().clone() for k, v in sd.items()}
    return out if dist.get_rank() == 0 else None


def _assert_equal(got: dict, ref: dict, what: str, keys: set | None = None) -> None:
    keys = ref.keys() if keys is None else keys
    for k in keys:
        assert torch.equal(got[k], ref[k]), f"{what}: {k} differs"


def test_initial_weights_are_identical_in_every_layout() -> None:
    results = {}
    for world in (1, 2, 4):
        results |= run_distributed(
            _initial_weights, world, LAYOUTS[world], MOE_LAYOUTS.get(world, {}), timeout_s=300
        )[0]
    for (model_name, layout_name), got in results.items():
        ref = results[model_name, "one_process"]
        what = f"{model_name} {layout_name}"
        if "lora" in layout_name:
            extra = got.keys() - ref.keys()
            assert extra and all(".lora_" in k for k in extra), what
            _assert_equal(got, results[model_name, "lora"], what)
            _assert_equal(got, ref, what, ref.keys())  # the base weights
        else:
            assert got.keys() == ref.keys(), what
            _assert_equal(got, ref, what)
    covered = {name for _, name in results}
    assert covered >= {"fsdp4", "hsdp2x2", "cp2", "cp2_fsdp2", "ep2", "ep2_efsdp2", "ep4"}
    tied = results["dense_tied", "one_process"]
    assert torch.equal(tied["output.weight"], tied["tok_embeddings.weight"])
