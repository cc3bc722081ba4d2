"""Pipeline parallel without ranks: the stage split, which stages a rank runs, the stages'
modules and names, the schedules' theoretical bubbles, and the one-line refusals of what PP
does not support yet."""

from dataclasses import replace

import pytest
import torch

from torchtitan_ablate.build import check_layout
from torchtitan_ablate.components.checkpoint.state import merge_parts
from torchtitan_ablate.config import ConfigError, load_config
from torchtitan_ablate.config.derived import resolved_reshard_after_forward
from torchtitan_ablate.config.parallelism_config import Parallelism
from torchtitan_ablate.distributed.parallel_dims import ParallelDims, ParallelDimsError
from torchtitan_ablate.distributed.pipeline_parallel import (
    default_fqns,
    plan_stages,
    split_stages,
    stage_ids,
    theoretical_bubble,
)
from torchtitan_ablate.models.qwen3 import Qwen3Model, qwen3_flavors
from torchtitan_ablate.models.qwen3.parallelize import check_fsdp_knobs

PP2 = ["--parallelism.pipeline_parallel_degree", "2"]


def test_default_split_counts_embedding_and_head_as_one_block_each():
    # 4 blocks + 2 ends = 6 units over 2 stages: 3 each.
    assert default_fqns(2, 4) == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "norm", "output"],
    ]
    # 7 units over 4 stages: the first 3 stages take one more (2, 2, 2, 1).
    assert default_fqns(4, 5) == [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "layers.2"],
        ["layers.3", "layers.4"],
        ["norm", "output"],
    ]


@pytest.mark.parametrize(
    "schedule, rank, expected",
    [
        ("1F1B", 1, [1]),
        ("Interleaved1F1B", 0, [0, 2]),  # looped
        ("InterleavedZeroBubble", 1, [1, 3]),
        ("ZBVZeroBubble", 0, [0, 3]),  # V: rank 0 holds the first and the last stage
        ("ZBVZeroBubble", 1, [1, 2]),
    ],
)
def test_stage_ids(schedule, rank, expected):
    p = Parallelism(pipeline_parallel_degree=2, pipeline_parallel_schedule=schedule)
    assert stage_ids(p, rank, len(plan_stages(p, 4))) == expected


def test_layers_per_stage_and_explicit_split():
    p = Parallelism(pipeline_parallel_degree=2, pipeline_parallel_layers_per_stage=2)
    with pytest.raises(ValueError, match="'1F1B' needs 1 stage per rank"):  # 6 units: 3 stages
        plan_stages(p, 4)
    p.pipeline_parallel_schedule = "Interleaved1F1B"
    assert len(plan_stages(p, 6)) == 4  # 8 units in stages of 2
    fqns = [["tok_embeddings"], ["layers.0", "layers.1", "norm", "output"]]
    assert plan_stages(Parallelism(pipeline_parallel_degree=2, module_fqns_per_model_part=fqns), 2)
    bad = [["tok_embeddings", "layers.1"], ["layers.0", "norm", "output"]]
    with pytest.raises(ValueError, match="in order"):
        plan_stages(Parallelism(pipeline_parallel_degree=2, module_fqns_per_model_part=bad), 2)


def test_stages_keep_their_modules_under_the_whole_models_names():
    with torch.device("meta"):
        model = Qwen3Model(qwen3_flavors["debugmodel"])
    first, last = split_stages(model, default_fqns(2, 4), [0, 1])
    assert last.tok_embeddings is None and first.norm is None and first.output is None
    names = [n for part in (first, last) for n, _ in part.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters(remove_duplicate=False))


def test_merged_parts_name_a_ranks_parameters_as_the_whole_model_does():
    """The checkpoint maps a rank's one optimizer over several parts (stages 0 and 3 here, as
    ZBVZeroBubble's rank 0) to names through the merged parts; the parts stay as they were."""
    with torch.device("meta"):
        model = Qwen3Model(replace(qwen3_flavors["debugmodel"], n_layers=6))
    # 8 units over 4 stages: embedding + layers.0, 1-2, 3-4, layers.5 + norm + head.
    parts = split_stages(model, default_fqns(4, 6), [0, 3])
    merged = dict(merge_parts(parts).named_parameters())
    own = {n: p for part in parts for n, p in part.named_parameters()}
    assert merged.keys() == own.keys() and all(merged[n] is p for n, p in own.items())
    assert any(n.startswith("layers.0.") for n in merged) and "output.weight" in merged
    assert list(parts[0].layers) == ["0"] and list(parts[1].layers) == ["5"]


def test_parallel_dims_counts_pp():
    pd = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=8, tp=2, pp=2)
    assert (pd.dp_shard, pd.dp) == (2, 2)
    with pytest.raises(ParallelDimsError, match="pipeline_parallel_degree \\* data_parallel"):
        ParallelDims(dp_replicate=1, dp_shard=2, cp=1, ep=1, world_size=2, pp=2)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--parallelism.pipeline_parallel_schedule", "GPipe"], "needs parallelism.pipeline_para"),
        (PP2 + ["--parallelism.pipeline_parallel_microbatch_size", "3"], "multiple of"),
        (PP2 + ["--training.dataset", "preference"], "(DPO) is not supported yet"),
        (
            PP2
            + ["--validation.enable", "true", "--validation.dataset_path", "x.jsonl"]
            + ["--validation.local_batch_size", "12"],
            "validation.local_batch_size = 12 with parallelism.pipeline_parallel_degree = 2 must",
        ),
        (PP2 + ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"], "written by one"),
    ],
)
def test_refusals_are_one_line(args, message):
    with pytest.raises(ConfigError) as e:
        load_config(args)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "args, message",
    [
        (PP2, "ties the embedding and output weights"),
        (
            PP2 + ["--model.flavor", "8B", "--model.n_layers", "1", "--lora.enable", "true"],
            "pipeline rank 1 holds no transformer block \\(norm, output\\), so no adapter",
        ),
    ],
)
def test_model_refusals(args, message):
    with pytest.raises(ConfigError, match=message):
        check_layout(load_config(args), 2)


def test_context_parallel_under_pp_is_accepted_with_its_sequence_rule():
    """PP 2 x CP 2 (the training equivalence: tests/integration/test_pipeline_context_parallel.py);
    the cp rule on the sequence still holds under PP (2 * cp must divide training.seq_len)."""
    args = PP2 + ["--parallelism.context_parallel_degree", "2", "--model.flavor", "8B"]
    pd = check_layout(load_config(args + ["--training.seq_len", "64"]), 4).parallel_dims
    assert (pd.pp, pd.cp, pd.dp_shard) == (2, 2, 1)
    with pytest.raises(ConfigError, match="must be divisible by 2 \\* context_parallel_degree"):
        check_layout(load_config(args + ["--training.seq_len", "66"]), 4)


def test_tensor_parallel_under_pp_is_accepted_with_its_sequence_rule():
    """PP 2 x TP 2 (the training equivalence: tests/integration/test_pipeline_tensor_parallel.py);
    sequence parallel's rule still holds under PP (tp must divide training.seq_len), and TP
    keeps refusing MoE models."""
    args = PP2 + ["--parallelism.tensor_parallel_degree", "2", "--model.flavor", "8B"]
    pd = check_layout(load_config(args + ["--training.seq_len", "64"]), 4).parallel_dims
    assert (pd.pp, pd.tp, pd.dp_shard) == (2, 2, 1)
    with pytest.raises(ConfigError, match="tensor_parallel_degree = 2 must divide training"):
        check_layout(load_config(args + ["--training.seq_len", "63"]), 4)


def test_expert_parallel_under_pp_borrows_each_slices_dp_ranks():
    # 30B-A3B: an untied MoE flavor (sizes only, nothing is built).
    args = PP2 + ["--parallelism.expert_parallel_degree", "2", "--model.flavor", "30B-A3B"]
    pd = check_layout(load_config(args), 4).parallel_dims
    assert (pd.pp, pd.dp_shard, pd.ep, pd.efsdp) == (2, 2, 2, 1)
    with pytest.raises(ConfigError, match="expert_parallel_degree = 2 must divide"):
        check_layout(load_config(args), 2)  # pp 2 on 2 ranks leaves dp_shard 1


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "InterleavedZeroBubble"])
def test_split_backward_schedules_keep_fsdp_weights_gathered(schedule):
    """Under PP, FSDP's default keeps each part's weights gathered from forward to backward (as
    torchtitan); "always" would leave the zero-bubble weight pass without gradients: refused."""
    args = PP2 + ["--parallelism.pipeline_parallel_schedule", schedule]
    config = load_config(args)
    assert resolved_reshard_after_forward(config.parallelism) == "never"
    check_fsdp_knobs(config, "cpu", use_fsdp=True)
    config = load_config(args + ["--parallelism.fsdp_reshard_after_forward", "always"])
    with pytest.raises(ConfigError, match="'default' or 'never' \\(it is 'always'\\)"):
        check_fsdp_knobs(config, "cpu", use_fsdp=True)
    one_rank = load_config(["--parallelism.fsdp_reshard_after_forward", "default"])
    assert resolved_reshard_after_forward(one_rank.parallelism) == "default"


def test_1f1b_needs_a_micro_batch_per_part():
    # 8B shapes (untied), PP 4 over 4 parts: 2 micro-batches cannot fill the pipeline.
    args = ["--model.flavor", "8B", "--parallelism.pipeline_parallel_degree", "4"]
    args += ["--training.local_batch_size", "2"]
    with pytest.raises(ConfigError, match="needs at least 4 micro-batches per loader batch, not 2"):
        check_layout(load_config(args), 4)
    check_layout(load_config(args + ["--parallelism.pipeline_parallel_schedule", "GPipe"]), 4)


@pytest.mark.parametrize(
    "schedule, pp, m, v, expected",
    [
        ("1F1B", 4, 8, 1, 3 / 11),  # (p - 1) / (m + p - 1)
        ("1F1B", 4, 16, 1, 3 / 19),
        ("GPipe", 2, 4, 1, 1 / 5),
        ("Interleaved1F1B", 4, 8, 2, 3 / 19),  # (p - 1) / (v m + p - 1)
        ("Interleaved1F1B", 4, 16, 2, 3 / 35),
        ("ZBVZeroBubble", 4, 8, 2, 0.0),  # m >= 2p with equal F, B, W times
        ("ZBVZeroBubble", 4, 7, 2, None),  # below 2p: no published figure
        ("InterleavedZeroBubble", 4, 8, 2, None),
    ],
)
def test_theoretical_bubble(schedule, pp, m, v, expected):
    got = theoretical_bubble(schedule, pp, m, v)
    assert got == expected if expected is None else got == pytest.approx(expected)
