"""memory_estimation.fewest_gpus: the world-size ladder skips what the model-state floor rules
out, the layouts are tried fastest first with few traces, and the answer fits.

The order tests stand a table of peaks in for the trace (fewest_gpus's `trace` argument), so
they check the search itself in a second; real traces run on the debug model and on shipped
recipes at reduced depth."""

import json

import pytest

from tests.helpers.estimator_configs import INTENDED_WORLD_SIZE
from torchtitan_ablate.config import load_config
from torchtitan_ablate.estimator import estimate_main
from torchtitan_ablate.estimator.cuda_model import context_gib
from torchtitan_ablate.estimator.fewest_gpus import SPEED_RULE, fewest_gpus
from torchtitan_ablate.estimator.floor import model_state
from torchtitan_ablate.estimator.world_sizes import floor_at


def _recipe(name: str, *extra: str):
    return load_config(["--job.config_file", f"train_configs/{name}.toml", *extra])


def _key(cfg) -> tuple:
    p = cfg.parallelism
    n = cfg.memory_estimation.world_size
    return n, cfg.activation_checkpoint.mode, p.data_parallel_replicate_degree


def stand_in(config, peaks: dict, rest: float):
    """A trace: the peak of `peaks[(world, ac, replicate)]`, else the model state + rest."""
    params = model_state(config)

    def trace(cfg) -> dict:
        n = cfg.memory_estimation.world_size
        peak = peaks.get(_key(cfg), floor_at(cfg, params, n).total_gib + rest)
        return {"peak_gib": peak, "context_gib": context_gib(n), "moe": False}

    return trace


def _traced(search) -> list[tuple]:
    return [(t.layout.world_size, t.layout.ac, t.layout.replicate) for t in search.trials]


def test_ladder_skips_the_floor_and_the_fastest_level_that_leaves_room_wins():
    # 8B: 122 GiB of model state on one GPU is ruled out untraced; at 2 GPUs (61 GiB) the
    # least-memory layout (AC full) fits; AC none does not; selective fits but leaves the
    # allocator too little room (77 GiB, 1.03x > 92% of 80): AC full is the answer.
    config = _recipe("qwen3_8b_fsdp")
    state = floor_at(config, model_state(config), 2).total_gib
    peaks = {(2, "full", 1): state + 5, (2, "none", 1): state + 40, (2, "selective", 1): 76.0}
    search = fewest_gpus(config, 80.0, log=lambda _: None, trace=stand_in(config, peaks, 70))
    assert _traced(search) == [(1, "full", 1), (2, "full", 1), (2, "none", 1), (2, "selective", 1)]
    assert [t.traced for t in search.trials] == [False, True, True, True]
    assert [t.mark for t in search.trials] == ["no", "yes", "no", "tight"]
    assert search.answer is search.trials[1]


def test_hsdp_per_node_is_tried_before_fsdp_and_a_level_that_cannot_fit_costs_one_trace():
    # The HSDP recipe (2 replicas) climbs to 16 GPUs, 2 nodes of 8. AC none's least-memory
    # layout (FSDP 16) does not fit, so HSDP with AC none is never traced; in the selective
    # level HSDP 2x8 (faster by the rule) is traced after FSDP 16 fits, and fits too.
    config = _recipe("qwen3_8b_hsdp")
    peaks = {(16, "full", 1): 40.0, (16, "none", 1): 90.0}
    peaks |= {(16, "selective", 1): 50.0, (16, "selective", 2): 60.0}
    search = fewest_gpus(config, 80.0, log=lambda _: None, trace=stand_in(config, peaks, 70))
    assert _traced(search) == [
        (1, "full", 1),  # floor: not traced
        (2, "full", 1),
        (4, "full", 1),
        (8, "full", 1),
        (16, "full", 1),
        (16, "none", 1),
        (16, "selective", 1),
        (16, "selective", 2),
    ]
    assert search.answer.layout.describe(config) == "HSDP 2x8, AC selective (2)"
    assert search.answer.layout.flags(config) == (
        "--memory_estimation.world_size 16 --activation_checkpoint.mode selective"
    )


def test_activations_beyond_the_card_stop_the_ladder():
    # More GPUs shrink only the model state: 100 GiB besides it never fits an 80 GiB card.
    config = _recipe("qwen3_8b_fsdp")
    search = fewest_gpus(config, 80.0, log=lambda _: None, trace=stand_in(config, {}, 100))
    assert search.answer is None and "more GPUs do not shrink" in search.reason
    assert sum(t.traced for t in search.trials) == 1


def test_fewest_gpus_end_to_end_writes_the_table(tmp_path, capsys):
    out = tmp_path / "fewest.json"
    cmd = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "64"]
    cmd += ["--training.local_batch_size", "2", "--memory_estimation.fewest_gpus", "true"]
    estimate_main(load_config([*cmd, "--memory_estimation.output", str(out)]))
    printed = capsys.readouterr().out
    assert SPEED_RULE in printed and "answer: 1 GPUs, FSDP 1, AC none" in printed
    doc = json.loads(out.read_text())
    assert doc["fits"] is True and doc["world_size"] == 1 and doc["peak_gib"] < 80
    tried = doc["fewest_gpus"]["tried"]
    assert [(t["world_size"], t["layout"]) for t in tried] == [
        (1, "FSDP 1, AC full"),
        (1, "FSDP 1, AC none"),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_moe_ep4", "qwen3_8b_cp"])
def test_search_needs_no_more_gpus_than_the_recipe_is_written_for(name):
    # Reduced depth keeps the traces short; the floor test (test_floor.py) covers real depth.
    config = _recipe(name, "--model.n_layers", "2", "--compile.enable", "false")
    search = fewest_gpus(config, 80.0, log=lambda _: None)
    assert search.answer is not None and search.answer.room
    assert search.answer.layout.world_size <= INTENDED_WORLD_SIZE[name]
    assert sum(t.traced for t in search.trials) <= 4


def test_a_layout_whose_model_state_cannot_fit_is_not_traced():
    # HSDP 2x1 at 2 GPUs replicates the whole 122 GiB of 8B model state: ruled out by the
    # floor, where FSDP 2 (61 GiB) is traced.
    config = _recipe("qwen3_8b_hsdp")
    fsdp = _recipe("qwen3_8b_hsdp", "--parallelism.data_parallel_replicate_degree", "1")
    peaks = {(2, "full", 1): floor_at(fsdp, model_state(fsdp), 2).total_gib + 5}
    search = fewest_gpus(config, 80.0, log=lambda _: None, trace=stand_in(config, peaks, 70))
    hsdp = [t for t in search.trials if t.layout.replicate == 2]
    assert [(t.layout.world_size, t.layout.ac, t.traced) for t in hsdp] == [(2, "full", False)]
    assert search.answer.layout.describe(config) == "FSDP 2, AC full"


def test_a_layout_names_the_degrees_that_stay_the_configs():
    # 8 GPUs = PP 2 (or TP 2) x FSDP 2 x CP 2: the shard degree is what the others leave.
    from torchtitan_ablate.estimator.fewest_gpus import Layout

    p = "--parallelism."
    for degree, name in (
        ("pipeline_parallel_degree", "PP 2, FSDP 2"),
        ("tensor_parallel_degree", "FSDP 2, TP 2"),
    ):
        config = _recipe("qwen3_8b_cp", p + degree, "2", p + "context_parallel_degree", "2")
        assert Layout(8, "full", 1, "default").describe(config) == f"{name}, CP 2, AC full"
