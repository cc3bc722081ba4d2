"""A checkpoint written by 4 FSDP ranks resumes on 2 ranks (replicate-only) and on 1 rank with
the same next-step losses as continuing on 4 (DCP reshards on load); one written at tensor
parallel 2 resumes on one process, and one written there resumes at tensor parallel 2."""

import shutil

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


def test_tp2_checkpoint_resumes_on_one_process_and_back(tmp_path):
    # Three steps, each saved; run "a" at TP 2 is the reference for both continuations.
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "1", "--training.steps", "3"]
    tp2 = ["--parallelism.tensor_parallel_degree", "2"]
    whole = run_distributed(train_layout, 2, str(tmp_path / "a"), ckpt + tp2)[0]["losses"]

    def resume(src: str, dst: str, step: int, world: int, args: list[str]) -> list[float]:
        name = f"checkpoint/step-{step}"  # a copy: the resumed run prunes its own folder
        shutil.copytree(tmp_path / src / name, tmp_path / dst / name)
        return run_distributed(train_layout, world, str(tmp_path / dst), ckpt + args)[0]["losses"]

    one = resume("a", "b", 1, 1, [])  # TP 2 -> one process: steps 2 and 3
    assert one == pytest.approx(whole[1:], rel=1e-5)
    back = resume("b", "c", 2, 2, tp2)  # one process -> TP 2: step 3
    assert back == pytest.approx(whole[2:], rel=1e-5)
