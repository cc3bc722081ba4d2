"""A checkpoint written by 4 FSDP ranks resumes on 2 ranks (replicate-only) and on 1 rank with
the same next-step losses as continuing on 4 (DCP reshards on load)."""

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_harness import train_layout

pytestmark = pytest.mark.slow


def test_save_on_4_resume_on_2_and_1(tmp_path):
    ckpt = ["--checkpoint.enable", "--training.steps", "4", "--checkpoint.interval", "100"]
    run_distributed(train_layout, 4, str(tmp_path / "a"), ckpt + ["--training.exit_at_step", "2"])
    for name in ("b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "checkpoint").symlink_to(tmp_path / "a" / "checkpoint")
    ckpt += ["--checkpoint.load_step", "2"]
    on4 = run_distributed(train_layout, 4, str(tmp_path / "a"), ckpt)[0]["losses"]
    rep = ["--parallelism.data_parallel_replicate_degree", "2"]
    on2 = run_distributed(train_layout, 2, str(tmp_path / "b"), ckpt + rep)[0]["losses"]
    on1 = run_distributed(train_layout, 1, str(tmp_path / "c"), ckpt)[0]["losses"]
    assert len(on4) == 2
    for losses in (on2, on1):
        assert losses == pytest.approx(on4, rel=1e-5)
