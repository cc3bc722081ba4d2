"""training.data_sharding end to end: with "rows", 2 gloo ranks train on exactly the global
batches of the 1-process run (same losses); with "documents" they read other rows."""

from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_harness import build_trainer


def _losses(dump_folder: str, args: list[str]) -> list[float]:
    return [r["loss"] for r in build_trainer(dump_folder, args).train()]


def test_rows_sharding_trains_like_one_process(tmp_path):
    one = run_distributed(_losses, 1, str(tmp_path / "one"), ["--training.local_batch_size", "8"])
    two = ["--training.local_batch_size", "4"]
    rows = run_distributed(
        _losses, 2, str(tmp_path / "rows"), two + ["--training.data_sharding", "rows"]
    )
    docs = run_distributed(_losses, 2, str(tmp_path / "docs"), two)
    for a, b in zip(rows[0], one[0], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (rows[0], one[0])
    assert rows[0] == rows[1]  # the loss is reduced over ranks
    assert max(abs(a - b) / b for a, b in zip(docs[0], one[0])) > 1e-4  # other rows


def test_rows_sharding_checkpoint_resumes_at_another_world_size(tmp_path):
    # Saved by 2 ranks at step 3, resumed by 1 rank: the data loader continues from rank 0's
    # state (the same on both ranks), so steps 4-5 are the uninterrupted 1-rank run's.
    common = ["--training.data_sharding", "rows", "--checkpoint.enable", "true"]
    common += ["--training.global_batch_size", "8"]
    one = ["--training.local_batch_size", "8"]
    ref = run_distributed(_losses, 1, str(tmp_path / "ref"), common + one)[0]
    two = ["--training.local_batch_size", "4", "--training.exit_at_step", "3"]
    first = run_distributed(_losses, 2, str(tmp_path / "run"), common + two)[0]
    rest = run_distributed(_losses, 1, str(tmp_path / "run"), common + one)[0]
    assert len(first) == 3 and len(rest) == 2
    for a, b in zip(first + rest, ref, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (first + rest, ref)
