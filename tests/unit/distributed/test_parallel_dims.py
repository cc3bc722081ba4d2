import contextlib
import io
import logging

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import run_distributed
from torchtitan_ablate import train
from torchtitan_ablate.build import check_layout
from torchtitan_ablate.config import ConfigError, load_config, run_main
from torchtitan_ablate.distributed.parallel_dims import ParallelDims, ParallelDimsError
from torchtitan_ablate.models.qwen3 import Qwen3Model
from torchtitan_ablate.models.qwen3.parallelize import check_fsdp_knobs, parallelize_qwen3


def test_dp_shard_minus_one_takes_the_rest():
    pd = ParallelDims(dp_replicate=2, dp_shard=-1, cp=2, ep=2, world_size=8)
    assert (pd.dp_shard, pd.dp, pd.efsdp) == (2, 4, 2)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (
            dict(dp_replicate=2, dp_shard=2, cp=1, ep=1, world_size=8),
            "= 4, but the world size is 8",
        ),
        (dict(dp_replicate=3, dp_shard=-1, cp=1, ep=1, world_size=8), "not divisible"),
        (dict(dp_replicate=1, dp_shard=2, cp=1, ep=4, world_size=2), "must divide data_parallel"),
        (dict(dp_replicate=1, dp_shard=0, cp=1, ep=1, world_size=2), "data_parallel_shard_degree"),
    ],
)
def test_bad_degrees(kwargs, needle):
    with pytest.raises(ParallelDimsError, match=needle):
        ParallelDims(**kwargs)


def test_model_constraints():
    # The one home of these rules: apply_ep and cp_shard_batch take them as met.
    pd = ParallelDims(dp_replicate=1, dp_shard=4, cp=1, ep=4, world_size=4)
    with pytest.raises(ParallelDimsError, match=r"= 4 must divide the number of experts \(6\)"):
        pd.check_model(num_experts=6, seq_len=64)
    with pytest.raises(ParallelDimsError, match="dense models"):
        pd.check_model(num_experts=0, seq_len=64)
    cp = ParallelDims(dp_replicate=1, dp_shard=1, cp=4, ep=1, world_size=4)
    with pytest.raises(ParallelDimsError, match="divisible by 2 \\* context_parallel_degree = 8"):
        cp.check_model(num_experts=0, seq_len=60)
    # PP x TP takes dense and MoE models alike (tests/integration/test_pipeline_moe.py).
    pptp = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, ep=1, world_size=4, tp=2, pp=2)
    pptp.check_model(num_experts=8, seq_len=64)
    pptp.check_model(num_experts=0, seq_len=64)


def _mesh_names(_):
    pd = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=dist.get_world_size())
    pd.build_meshes("cpu")
    with pytest.raises(KeyError):
        pd.mesh("dp_shard_cp")  # never requested, so never built (a gloo group each)
    return sorted(pd._meshes)


def test_meshes_built_are_the_ones_requested():
    assert run_distributed(_mesh_names, 2, None)[0] == ["dp", "fsdp", "loss", "tp", "world"]


def test_experts_view_puts_each_tp_coordinate_beside_its_copies():
    # World order (pp, dp_shard, tp) = 2 x 4 x 2; ep 2 borrows dp_shard: rank
    # 8 * pp + 4 * e + 2 * ep_rank + tp for e in efsdp's dp_shard part.
    pd = ParallelDims(dp_replicate=1, dp_shard=4, cp=1, ep=2, world_size=16, tp=2, pp=2)
    assert pd.efsdp == 4  # dp_shard * cp * tp / ep
    grid = pd.experts_ranks()
    assert grid.shape == (2, 1, 4, 2)
    # An ep group: two dp_shard ranks of one tp coordinate (rank 0's peer is 2, not 1).
    assert grid[0, 0, :, 0].tolist() == [0, 1, 4, 5]  # efsdp: the copies of experts 0..E/2
    assert grid[0, 0, 0].tolist() == [0, 2]
    assert grid[1, 0, 3].tolist() == [13, 15]
    assert sorted(grid.flatten().tolist()) == list(range(16))
    # Without TP the view is the world's order, as before.
    no_tp = ParallelDims(dp_replicate=2, dp_shard=4, cp=1, ep=2, world_size=8)
    assert no_tp.experts_ranks().flatten().tolist() == list(range(8))


def _experts_groups(tp: int, ep: int) -> dict:
    pd = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=ep, world_size=4, tp=tp)
    pd.build_meshes("cpu")
    names = ("ep", "efsdp", "experts_fsdp", "tp")
    return {n: pd.mesh(n).mesh.flatten().tolist() for n in names} | {"all": sorted(pd._meshes)}


def test_tp_builds_the_experts_meshes_with_and_without_ep():
    ep2 = run_distributed(_experts_groups, 4, 2, 2)
    # World (dp_shard 2, tp 2): ep pairs ranks of one tp coordinate, FSDP shards the experts
    # over the tp ranks (efsdp = 2 * 2 / 2), which sum their gradients.
    assert [o["ep"] for o in ep2] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [o["experts_fsdp"] for o in ep2] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert ep2[0]["tp"] == [0, 1]
    # ep 1: the experts stay whole per rank group and FSDP shards them over dp_shard * tp.
    ep1 = run_distributed(_experts_groups, 4, 2, 1)
    assert [o["experts_fsdp"] for o in ep1] == [[0, 1, 2, 3]] * 4
    assert [o["ep"] for o in ep1] == [[0], [1], [2], [3]]
    assert "experts" in ep1[0]["all"]


ZBV = ["--parallelism.pipeline_parallel_degree", "2"]
ZBV += ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]


@pytest.mark.parametrize(
    "device, use_fsdp, args, needle",
    [
        ("cpu", True, ["--parallelism.fsdp_cpu_offload", "true"], "needs CUDA devices"),
        (
            "cuda",
            False,
            ["--parallelism.fsdp_cpu_offload", "true", "--training.mixed_precision_param"]
            + ["float32"],
            "fsdp_cpu_offload = true needs FSDP.*mixed_precision_param = 'float32'",
        ),
        ("cuda", True, ["--parallelism.fsdp_cpu_offload", "true"], None),
        (
            "cpu",
            False,
            ["--parallelism.fsdp_reshard_after_forward", "always"],
            "fsdp_reshard_after_forward = 'always' needs FSDP.*cpu_mixed_precision",
        ),
        ("cpu", True, ["--parallelism.fsdp_reshard_after_forward", "always"], None),
        ("cpu", False, ["--parallelism.fsdp_reshard_after_forward", "never"], None),
        (
            "cpu",
            False,
            ["--training.mixed_precision_reduce", "bfloat16"],
            "mixed_precision_reduce = 'bfloat16' needs FSDP",
        ),
        ("cuda", True, ["--training.mixed_precision_reduce", "bfloat16"], None),
        # Split-backward schedules miss the gradients of blocks resharded after forward: the
        # default keeps them gathered under PP, an explicit "always" is refused.
        (
            "cpu",
            True,
            ZBV + ["--parallelism.fsdp_reshard_after_forward", "always"],
            "'ZBVZeroBubble' with FSDP needs .*reshard_after_forward = 'default' or 'never'",
        ),
        ("cpu", True, ZBV, None),
        ("cpu", True, ZBV + ["--parallelism.fsdp_reshard_after_forward", "never"], None),
        ("cpu", False, ZBV, None),
    ],
)
def test_fsdp_knobs_without_fsdp_are_errors(device, use_fsdp, args, needle):
    config = load_config(args)
    if needle is None:
        check_fsdp_knobs(config, device, use_fsdp)
        return
    with pytest.raises(ConfigError, match=needle):
        check_fsdp_knobs(config, device, use_fsdp)


@pytest.mark.parametrize("mode, logged", [("full", "full"), ("selective", "selective (2)")])
def test_ac_log_names_the_option_only_for_selective(caplog, mode, logged):
    config = load_config(["--activation_checkpoint.mode", mode])
    with torch.device("meta"):
        model = Qwen3Model(check_layout(config, 1).model_args)
    pd = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, ep=1, world_size=1)
    with caplog.at_level(logging.INFO, logger="torchtitan_ablate"):
        parallelize_qwen3(model, pd, config, "cpu")  # one CPU rank in fp32: no FSDP, no mesh
    assert f"activation checkpointing: {logged}" in caplog.messages


def _with_base(tmp_path, args: list[str]) -> list[str]:
    """A short run's arguments plus `args`, each key once (args win)."""
    base = {"--job.dump_folder": str(tmp_path), "--training.steps": "1", "--training.seq_len": "32"}
    return [x for k, v in base.items() if k not in args for x in (k, v)] + args


def _run_start(world_size: int, args: list[str]) -> list[tuple[int, list[str]]]:
    """Per rank: the exit code of a run's start and the `config error:` lines it printed."""
    return run_distributed(_start, world_size, args)


def _start(args) -> tuple[int, list[str]]:
    # The rank reads its own stderr: forkserver ranks do not write to the test's descriptors.
    err = io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err):
        try:
            run_main(train.main, args)
        except SystemExit as e:
            code = e.code
    return code, [x for x in err.getvalue().splitlines() if x.startswith("config error:")]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--parallelism.data_parallel_replicate_degree", "3"], "world size 2 is not divisible"),
        (
            ["--model.flavor", "debugmodel_moe", "--parallelism.expert_parallel_degree", "2"]
            + ["--model.vocab_size", "2048"],
            None,
        ),
        (["--parallelism.expert_parallel_degree", "2"], "dense models need"),
        (
            ["--model.flavor", "debugmodel_moe", "--model.num_experts", "3"]
            + ["--parallelism.expert_parallel_degree", "2"],
            "expert_parallel_degree = 2 must divide the number of experts (3)",
        ),
        (["--parallelism.fsdp_cpu_offload", "true"], "needs CUDA devices"),
        (
            ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "66"],
            "divisible by 2 * context_parallel_degree = 4",
        ),
        (
            ["--model.flavor", "debugmodel_moe", "--parallelism.tensor_parallel_degree", "2"]
            + ["--model.vocab_size", "2048"],
            None,
        ),
        (
            ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "33"],
            "tensor_parallel_degree = 2 must divide training.seq_len = 33",
        ),
    ],
)
def test_bad_layout_fails_at_start_with_one_line(tmp_path, args, needle):
    ranks = _run_start(2, _with_base(tmp_path, args))
    if needle is None:  # a valid layout for contrast
        assert ranks == [(0, []), (0, [])]
        return
    for code, lines in ranks:
        assert code == 2 and len(lines) == 1 and needle in lines[0], ranks


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--parallelism.fsdp_reshard_after_forward", "always"], "needs FSDP"),
        (["--training.mixed_precision_reduce", "bfloat16"], "needs FSDP"),
        (["--parallelism.fsdp_reshard_after_forward", "never"], None),  # what happens anyway
    ],
)
def test_fsdp_knobs_on_one_cpu_rank_fail_at_start(tmp_path, args, needle):
    ((code, lines),) = _run_start(1, _with_base(tmp_path, args))
    if needle is None:
        assert (code, lines) == (0, [])
        return
    assert code == 2 and len(lines) == 1 and needle in lines[0]
