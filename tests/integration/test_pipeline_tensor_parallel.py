"""Pipeline parallel with tensor parallel on gloo ranks trains like the one-process run (fp32):
PP 2 x TP 2 on 4 ranks, per-step losses within 1e-5 relative, gradient norms within 1e-4
relative, final parameters within 1e-4; validation (the schedule's eval after every step) gives
the held-out losses within 1e-5, the same on every rank.

Under sequence parallel each tp rank holds [mb, seq / tp, dim] of the residual stream, and
that local slice is what crosses a stage boundary: the next part makes it a Shard(1) DTensor
again before its blocks, and the last part's loss covers its tp rank's tokens, summed over tp
with the loss. A wrong boundary shape fails the first step; a slice taken as the whole
sequence (wrong mask, wrong RoPE positions) moves the losses far past 1e-5; a gradient norm
missing the other stage's or the other tp rank's squares misses 1e-4. Schedules: 1F1B (one
part per rank), Interleaved1F1B and ZBVZeroBubble (two parts per rank; ZBV splits each backward
into input and weight passes, over TP's DTensor weights). A ZBVZeroBubble checkpoint resumes
at PP 2 x TP 2 and on one process. One 4-rank group trains all in turn; one process the
reference and the one-process resume. The debug model is untied and narrowed to dim 64
(tests/helpers/pipeline_runs.py).
"""

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_harness import assert_same_training
from tests.helpers.pipeline_runs import NARROW_ARGS, VAL, Case, pp2_with, train_narrow_cases

pytestmark = pytest.mark.slow

P = "--parallelism."
# Three steps of 8 sequences of 32 tokens, in micro-batches of 2: each tp rank holds 16 tokens
# of each sequence between blocks.
ARGS = NARROW_ARGS
PP2_TP2 = pp2_with("tensor_parallel_degree")
SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
CKPT = ARGS + ["--checkpoint.enable", "--checkpoint.interval", "1"]
ZBV = [P + "pipeline_parallel_schedule", "ZBVZeroBubble"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], dict]:
    """Every rank's results of the PP 2 x TP 2 group, and the one-process runs."""
    root = str(tmp_path_factory.mktemp("pptp"))
    cases: list[Case] = [
        (s, ARGS + VAL + PP2_TP2 + [P + "pipeline_parallel_schedule", s], None) for s in SCHEDULES
    ]
    # A checkpoint of TP's DTensors, two parts per rank; resumed at PP 2 x TP 2 and on one rank.
    cases += [("ckpt", CKPT + PP2_TP2 + ZBV, None), ("ckpt_pptp", CKPT + PP2_TP2 + ZBV, "ckpt")]
    pptp = run_distributed(train_narrow_cases, 4, root, cases, timeout_s=300)
    ref_cases: list[Case] = [("reference", ARGS + VAL, None), ("ckpt_one", CKPT, "ckpt")]
    one = run_distributed(train_narrow_cases, 1, root, ref_cases)[0]
    return pptp, one


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_tp2_matches_single_process(runs, schedule):
    pptp, one = runs
    # Every rank logs the same loss and gradient norm (summed over the pp, then the tp ranks).
    for r in pptp:
        assert r[schedule]["losses"] == pptp[0][schedule]["losses"]
        assert r[schedule]["grad_norms"] == pptp[0][schedule]["grad_norms"]
        assert r[schedule]["validation"] == pptp[0][schedule]["validation"]
    assert_same_training(pptp[0][schedule], one["reference"], grad_norm_rtol=1e-4)


def test_pp2_tp2_checkpoint_resumes_exactly_and_on_one_process(runs):
    """Each rank saves its tp shards of its two parts' weights and moments under the whole
    model's names: the resume at PP 2 x TP 2 gives the uninterrupted run's losses after step 1
    and final weights bit for bit, the one-process resume within the tolerances."""
    pptp, one = runs
    whole = pptp[0]["ckpt"]
    after_step1 = {"losses": whole["losses"][1:], "params": whole["params"]}
    assert_same_training(pptp[0]["ckpt_pptp"], after_step1, loss_rtol=0, atol=0)
    assert_same_training(one["ckpt_one"], after_step1)
