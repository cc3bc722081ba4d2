"""The model-state floor (parameters, gradients, optimizer states per GPU, no trace), the layout
error that names a valid world size, and the advice that offers only changes that can work."""

import glob

import pytest

from tests.helpers.estimator_configs import DENSE, INTENDED_WORLD_SIZE, MOE, _config
from torchtitan_ablate.build import check_layout
from torchtitan_ablate.config import ConfigError, load_config
from torchtitan_ablate.estimator import estimate
from torchtitan_ablate.estimator.advice import advise
from torchtitan_ablate.estimator.floor import model_state
from torchtitan_ablate.estimator.world_sizes import (
    fewest_by_floor,
    floor_at,
    smallest_world_size,
    with_smallest_world_size,
)

EP2_HSDP_LORA = ["--parallelism.expert_parallel_degree", "2"]
EP2_HSDP_LORA += ["--parallelism.data_parallel_replicate_degree", "2", "--lora.enable", "true"]


def _recipe(name: str, *extra: str):
    return load_config(["--job.config_file", f"train_configs/{name}.toml", *extra])


@pytest.mark.parametrize(
    "base, world_size, extra",
    [
        (DENSE, 2, []),
        (MOE, 4, EP2_HSDP_LORA),
        (DENSE, 4, ["--parallelism.tensor_parallel_degree", "2"]),
        (MOE, 4, ["--parallelism.tensor_parallel_degree", "2"]),
        (
            MOE,
            4,
            [
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.expert_parallel_degree",
                "2",
            ],
        ),
    ],
    ids=["fsdp2_dense", "moe_ep2_hsdp_lora", "tp2_fsdp2_dense", "moe_tp2_fsdp2", "moe_tp2_ep2"],
)
def test_floor_is_the_traced_model_state(base, world_size, extra):
    # Parameters and Adam's moments are resident through the whole traced step: the floor,
    # computed on the meta device, must be exactly what the tracker counts (EP splits the
    # experts, HSDP replicates, LoRA freezes the base: no moments for it; with TP, FSDP shards
    # the experts over the tp ranks too).
    config = _config(base, world_size, *extra)
    floor = floor_at(config, model_state(config), world_size)
    cats = estimate(config)["by_category"]
    assert floor.parameters_gib == cats["parameters"]
    assert floor.optimizer_gib == cats["optimizer_states"]


def test_pipeline_floor_is_the_busiest_pipeline_rank():
    # The 8B shapes (untied) cut to 4 blocks with a small vocabulary: PP 2 puts the embedding
    # and 2 blocks on one rank, 2 blocks, the final norm and the head on the other, each
    # FSDP-sharded over 2. The floor is the second's; the trace reports the rank of the higher
    # peak, the first here: they differ by the final norm's shard (8 KiB of 0.73 GiB).
    small = ["--model.n_layers", "4", "--model.vocab_size", "1024", "--training.seq_len", "64"]
    small += ["--training.local_batch_size", "2", "--compile.enable", "false"]
    pp2 = _recipe("qwen3_8b_fsdp", *small, "--parallelism.pipeline_parallel_degree", "2")
    pp2.memory_estimation.world_size = 4
    floor = floor_at(pp2, model_state(pp2), 4)
    cats = estimate(pp2)["by_category"]
    assert floor.parameters_gib == pytest.approx(cats["parameters"], abs=8 * 1024 / 1024**3)
    # Two moments of the norm shard and its step count.
    assert floor.optimizer_gib == pytest.approx(cats["optimizer_states"], abs=20 * 1024 / 1024**3)
    whole = floor_at(_recipe("qwen3_8b_fsdp", *small), model_state(pp2), 2)
    assert floor.total_gib == pytest.approx(whole.total_gib / 2, rel=0.01)


def test_floor_of_8b_on_one_gpu_is_its_fp32_state():
    # 8.19B fp32 parameters, fp32 gradients and two fp32 moments: 16 bytes each.
    floor = floor_at(_recipe("qwen3_8b_fsdp"), model_state(_recipe("qwen3_8b_fsdp")), 1)
    assert floor.total_gib == pytest.approx(8.19e9 * 16 / 1024**3, rel=0.01)
    assert floor.optimizer_gib == pytest.approx(2 * floor.gradients_gib, rel=1e-3)


def test_floor_beyond_the_card_offers_gpus_not_batch_or_recomputation():
    config = _recipe("qwen3_8b_fsdp", "--memory_estimation.world_size", "1")
    est = {"world_size": 1, "peak_gib": 135.0, "context_gib": 0.5, "moe": False}  # no trace
    fits, line, tried, floor = advise(config, est, 80.0)
    assert not fits and floor.total_gib > 80
    assert "parameters, gradients and optimizer states alone take 122.05 GiB" in line
    assert [desc.split(" (")[0] for desc, _ in tried] == ["--memory_estimation.world_size 2"]


@pytest.mark.parametrize("toml", sorted(glob.glob("train_configs/*.toml")))
def test_floor_allows_each_recipe_its_intended_world_size(toml):
    # Real depth (no trace needed): on the 80 GB cards the recipes are written for, the floor
    # never asks for more GPUs than the recipe's header names.
    name = toml.split("/")[-1][: -len(".toml")]
    config = load_config(["--job.config_file", toml])
    start = smallest_world_size(config)
    fewest = fewest_by_floor(config, model_state(config), 80.0, start)
    assert fewest is not None and fewest <= INTENDED_WORLD_SIZE[name], (name, fewest)
    if name == "qwen3_30b_a3b":  # 455 GiB of model state: 8 GPUs at least, found at once
        assert fewest == 8


@pytest.mark.parametrize(
    "name, smallest",
    [("qwen3_moe_ep", 8), ("qwen3_moe_ep4", 4), ("qwen3_30b_a3b_lora_ep", 8)]
    + [("qwen3_8b_cp", 4), ("qwen3_8b_hsdp", 2)],
)
def test_layout_error_names_the_smallest_world_size(name, smallest):
    # The five recipes that fail at the default world size of 1.
    config = _recipe(name, "--memory_estimation.world_size", "1")
    with pytest.raises(ConfigError) as e:
        check_layout(config, 1)
    line = str(with_smallest_world_size(e.value, config, 1))
    assert line.endswith(f"valid at is {smallest}: --memory_estimation.world_size {smallest}")
    assert "\n" not in line
    check_layout(config, smallest)
    with pytest.raises(ConfigError, match=f"world_size {smallest}"):
        estimate(config)  # the estimator raises it before building anything
