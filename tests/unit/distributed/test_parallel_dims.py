import pytest

from tests.dist_utils import run_distributed
from torchtitan_ablate import train
from torchtitan_ablate.config import run_main
from torchtitan_ablate.distributed.parallel_dims import ParallelDims, ParallelDimsError


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
    pd = ParallelDims(dp_replicate=1, dp_shard=4, cp=1, ep=4, world_size=4)
    with pytest.raises(ParallelDimsError, match="divide the number of experts"):
        pd.check_model(num_experts=6, seq_len=64)
    with pytest.raises(ParallelDimsError, match="dense models"):
        pd.check_model(num_experts=0, seq_len=64)
    cp = ParallelDims(dp_replicate=1, dp_shard=1, cp=4, ep=1, world_size=4)
    with pytest.raises(ParallelDimsError, match="divisible by 2 \\* context_parallel_degree = 8"):
        cp.check_model(num_experts=0, seq_len=60)


def _start(args):
    try:
        run_main(train.main, args)
    except SystemExit as e:
        return e.code
    return 0


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
        (["--parallelism.fsdp_cpu_offload", "true"], "needs CUDA devices"),
        (
            ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "66"],
            "divisible by 2 * context_parallel_degree = 4",
        ),
    ],
)
def test_bad_layout_fails_at_start_with_one_line(tmp_path, capfd, args, needle):
    base = ["--job.dump_folder", str(tmp_path), "--training.steps", "1", "--training.seq_len", "32"]
    codes = run_distributed(_start, 2, base + args)
    err = capfd.readouterr().err
    if needle is None:  # a valid layout for contrast
        assert codes == [0, 0]
        return
    assert codes == [2, 2]
    lines = [x for x in err.splitlines() if x.startswith("config error:")]
    assert lines and needle in lines[0]
