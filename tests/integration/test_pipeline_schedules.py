"""Pipeline parallel on gloo ranks trains like the one-process run (fp32), with every schedule:
per-step losses within 1e-5 relative, final parameters within 1e-4 (the tolerances of
test_parallel_equivalence). The debug model is untied here (PP refuses tied embeddings)."""

import shutil
from dataclasses import replace

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_harness import assert_same_training, train_layout
from torchtitan_ablate.models.qwen3 import qwen3_flavors

pytestmark = pytest.mark.slow

P = "--parallelism."
# Three steps of 4 sequences of 32 tokens, 4 micro-batches: enough to see the schedules'
# gradients, clipping and the optimizer's updates line up.
ARGS = ["--training.steps", "3", "--training.seq_len", "32", "--model.n_layers", "4"]


def _train_untied(dump_folder: str, args: list[str]) -> dict:
    qwen3_flavors["debugmodel"] = replace(qwen3_flavors["debugmodel"], tie_embeddings=False)
    return train_layout(dump_folder, args)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return run_distributed(_train_untied, 1, str(tmp_path_factory.mktemp("ref")), ARGS)[0]


SCHEDULES = {
    "1F1B": [],
    "GPipe": [],
    # 2 stages per rank: 4 stages of the 6 units (embedding, 4 blocks, norm + head).
    "Interleaved1F1B": [],
    "ZBVZeroBubble": [],
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_schedule_matches_single_process(tmp_path, reference, schedule):
    args = ARGS + [P + "pipeline_parallel_degree", "2", P + "pipeline_parallel_schedule", schedule]
    out = run_distributed(_train_untied, 2, str(tmp_path), args + SCHEDULES[schedule])
    assert out[0]["losses"] == out[1]["losses"]  # both stages log the last stage's loss
    assert_same_training(out[0], reference)


def test_pp2_fsdp2_matches_single_process(tmp_path, reference):
    """PP 2 x FSDP 2: each stage sharded over its own 2 ranks (4 sequences per dp rank, in
    micro-batches of 2)."""
    args = ARGS + [P + "pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]
    args += [P + "pipeline_parallel_microbatch_size", "2"]
    out = run_distributed(_train_untied, 4, str(tmp_path), args)
    assert all(o["losses"] == out[0]["losses"] for o in out)
    assert_same_training(out[0], reference)


def test_pp2_checkpoint_resumes_exactly_and_on_one_process(tmp_path):
    """Each rank saves its own part's weights and moments under the whole model's names, so a
    PP 2 checkpoint resumes at PP 2 and on one process (DCP reshards by name) alike."""
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "1"] + ARGS
    pp2 = [P + "pipeline_parallel_degree", "2"]
    whole = run_distributed(_train_untied, 2, str(tmp_path / "a"), ckpt + pp2)[0]["losses"]
    for dst, world, args in (("b", 2, pp2), ("c", 1, [])):
        name = "checkpoint/step-1"  # a copy: the resumed run prunes its own folder
        shutil.copytree(tmp_path / "a" / name, tmp_path / dst / name)
        got = run_distributed(_train_untied, world, str(tmp_path / dst), ckpt + args)[0]
        assert got["losses"] == pytest.approx(whole[1:], rel=1e-5), dst
