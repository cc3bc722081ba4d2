"""Pipeline parallel on gloo ranks trains like the one-process run (fp32), with every schedule:
per-step losses within 1e-5 relative, final parameters within 1e-4 (the tolerances of
test_parallel_equivalence), and validates alike (the schedule's eval after every step: held-out
losses within 1e-5, the same on every rank, training untouched); a PP 2 checkpoint resumes at
PP 2 and on one process (also one of two parts per rank, Interleaved1F1B, resumed with
ZBVZeroBubble too), and its HF export (checkpoint.last_save_in_hf) holds the whole model.

The debug model is untied (PP refuses tied embeddings) and narrowed to dim 64 by
tests/helpers/pipeline_runs.py.
Three process groups in all, each training several configs in turn (a spawn and its first
step cost more than the training): 2 ranks (every schedule, 1F1B with compiled blocks, then the
PP 2 checkpoint runs and their PP 2 resumes), 1 rank (the reference, then the one-process
resumes), 4 ranks (PP 2 x FSDP 2).
"""

import os

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_harness import assert_same_training
from tests.helpers.pipeline_runs import VAL, Case
from tests.helpers.pipeline_runs import train_narrow_cases as _runs

pytestmark = pytest.mark.slow

P = "--parallelism."
PP2 = [P + "pipeline_parallel_degree", "2"]
# Three steps of 8 sequences of 32 tokens (in micro-batches of 2 under PP): enough to see the
# schedules' gradients, clipping and the optimizer's updates line up.
ARGS = ["--training.steps", "3", "--training.seq_len", "32", "--model.n_layers", "4"]
MICRO2 = [P + "pipeline_parallel_microbatch_size", "2"]
# 2 stages per rank for the interleaved ones: 4 stages of the 6 units (embedding, 4 blocks,
# norm + head).
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble")
# Every checkpointed run also writes its last step in HF format (float32: comparable to 1e-4).
HF = ["--checkpoint.last_save_in_hf", "true", "--checkpoint.export_dtype", "float32"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "1", *HF] + ARGS
INTERLEAVED = [P + "pipeline_parallel_schedule", "Interleaved1F1B"]
ZBV = [P + "pipeline_parallel_schedule", "ZBVZeroBubble"]
# GPipe validates the reference's 16 rows in one batch of 16: two schedule evals of 8 rows each.
VAL_ROWS = {"GPipe": ["--validation.local_batch_size", "16", "--validation.steps", "1"]}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("pp"))


@pytest.fixture(scope="module")
def pp2(root) -> list[dict]:
    """Every rank's results of the 2-rank group."""
    schedule = P + "pipeline_parallel_schedule"
    cases: list[Case] = [
        (s, ARGS + VAL + PP2 + MICRO2 + [schedule, s] + VAL_ROWS.get(s, []), None)
        for s in SCHEDULES
    ]
    cases += [("compiled", ARGS + PP2 + MICRO2 + ["--compile.enable"], None)]
    cases += [("ckpt", CKPT + PP2, None), ("ckpt_pp2", CKPT + PP2, "ckpt")]
    # Two parts per rank, one optimizer over both: saved with Interleaved1F1B (rank 0 holds
    # stages 0 and 2), resumed with it and with ZBVZeroBubble (rank 0: stages 0 and 3).
    cases += [("ckpt_i", CKPT + PP2 + INTERLEAVED, None)]
    cases += [
        ("ckpt_i_i", CKPT + PP2 + INTERLEAVED, "ckpt_i"),
        ("ckpt_i_zbv", CKPT + PP2 + ZBV, "ckpt_i"),
    ]
    return run_distributed(_runs, 2, root, cases, timeout_s=420)


@pytest.fixture(scope="module")
def one(root, pp2) -> dict:
    """The one-process reference, and the one-process resume of the PP 2 checkpoint."""
    cases: list[Case] = [("reference", ARGS + VAL, None), ("ckpt_one", CKPT, "ckpt")]
    cases += [("ckpt_i_one", CKPT, "ckpt_i")]
    return run_distributed(_runs, 1, root, cases)[0]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_schedule_matches_single_process(pp2, one, schedule):
    for key in ("losses", "validation"):  # both log the last stage's
        assert pp2[0][schedule][key] == pp2[1][schedule][key]
    assert_same_training(pp2[0][schedule], one["reference"])


def test_pp2_with_compiled_blocks_matches_single_process(pp2, one):
    # Each part's blocks compiled (1F1B): Inductor reorders float math, so compile's tolerances
    # (test_compile.py): close, not bit-equal.
    assert_same_training(pp2[0]["compiled"], one["reference"], loss_rtol=1e-4, atol=1e-3)


def test_pp2_fsdp2_matches_single_process(root, one):
    """PP 2 x FSDP 2: each stage sharded over its own 2 ranks (4 sequences per dp rank, in
    micro-batches of 2), one part per rank (1F1B) and two (ZBVZeroBubble, whose eval also runs
    its gradient-reduce actions over the sharded parts)."""
    args = ARGS + VAL + PP2 + MICRO2 + ["--training.local_batch_size", "4"]
    cases: list[Case] = [("pp2_fsdp2", args, None), ("pp2_fsdp2_zbv", args + ZBV, None)]
    out = run_distributed(_runs, 4, root, cases)
    for name, _, _ in cases:
        for key in ("losses", "validation"):
            assert all(o[name][key] == out[0][name][key] for o in out)
        assert_same_training(out[0][name], one["reference"])


def test_pp2_checkpoint_resumes_exactly_and_on_one_process(pp2, one):
    """Each rank saves its own part's weights and moments under the whole model's names, so a
    PP 2 checkpoint resumes at PP 2 and on one process (DCP reshards by name) alike: the
    uninterrupted run's losses after step 1 and its final weights."""
    whole = pp2[0]["ckpt"]
    assert len(whole["losses"]) == 3
    after_step1 = {"losses": whole["losses"][1:], "params": whole["params"]}
    for got in (pp2[0]["ckpt_pp2"], one["ckpt_one"]):
        assert_same_training(got, after_step1)


def test_checkpoint_of_several_parts_per_rank_resumes_exactly_and_on_one_process(pp2, one):
    """A rank's parts share one optimizer: its state is saved under the whole model's names
    (the parts merged by name), so an Interleaved1F1B checkpoint resumes with Interleaved1F1B
    and ZBVZeroBubble (other stages on each rank) with the uninterrupted run's losses and final
    weights, and on one process within the tolerances (DCP reshards by name)."""
    whole = pp2[0]["ckpt_i"]
    after_step1 = {"losses": whole["losses"][1:], "params": whole["params"]}
    for name in ("ckpt_i_i", "ckpt_i_zbv"):
        assert pp2[0][name]["losses"] == after_step1["losses"], name
        assert_same_training(pp2[0][name], after_step1, atol=0)
    assert_same_training(one["ckpt_i_one"], after_step1)


def test_hf_export_of_a_pp2_run_is_the_whole_model(root, pp2, one):
    """checkpoint.last_save_in_hf reads the DCP checkpoint the pipeline ranks just wrote, each
    its own parts under the whole model's names: the export holds every tensor, equal to the
    exports of the PP 2 and one-process resumes of the same training."""
    exports = [
        load_file(os.path.join(root, run, "checkpoint", "step-3", "hf", "model.safetensors"))
        for run in ("ckpt", "ckpt_pp2", "ckpt_one")
    ]
    whole = exports[0]
    assert any(k.startswith("lm_head") for k in whole) and any("layers.3." in k for k in whole)
    for other in exports[1:]:
        assert other.keys() == whole.keys()
        for k in whole:
            torch.testing.assert_close(other[k], whole[k], rtol=0, atol=1e-4)
