"""Pipeline parallel with tensor parallel on gloo ranks trains like the one-process run (fp32):
PP 2 x TP 2 on 4 ranks, per-step losses within 1e-5 relative, gradient norms within 1e-4
relative, final parameters within 1e-4.

Under sequence parallel each tp rank holds [mb, seq / tp, dim] of the residual stream, and
that local slice is what crosses a stage boundary: the next part makes it a Shard(1) DTensor
again before its blocks, and the last part's loss covers its tp rank's tokens, summed over tp
with the loss. A wrong boundary shape fails the first step; a slice taken as the whole
sequence (wrong mask, wrong RoPE positions) moves the losses far past 1e-5; a gradient norm
missing the other stage's or the other tp rank's squares misses 1e-4. Schedules: 1F1B (one
part per rank), Interleaved1F1B and ZBVZeroBubble (two parts per rank; ZBV splits each backward
into input and weight passes, over TP's DTensor weights). One 4-rank group trains all in turn;
one process the reference. The debug model is untied and narrowed to dim 64
(tests/helpers/pipeline_runs.py).
"""

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_harness import assert_same_training
from tests.helpers.pipeline_runs import Case, train_narrow_cases

pytestmark = pytest.mark.slow

P = "--parallelism."
# Three steps of 8 sequences of 32 tokens, in micro-batches of 2: each tp rank holds 16 tokens
# of each sequence between blocks.
ARGS = ["--training.steps", "3", "--training.seq_len", "32", "--model.n_layers", "4"]
PP2_TP2 = [
    P + "pipeline_parallel_degree",
    "2",
    P + "tensor_parallel_degree",
    "2",
    P + "pipeline_parallel_microbatch_size",
    "2",
]
SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], dict]:
    """Every rank's results of the PP 2 x TP 2 group, and the one-process reference."""
    root = str(tmp_path_factory.mktemp("pptp"))
    cases: list[Case] = [
        (s, ARGS + PP2_TP2 + [P + "pipeline_parallel_schedule", s], None) for s in SCHEDULES
    ]
    pptp = run_distributed(train_narrow_cases, 4, root, cases, timeout_s=300)
    one = run_distributed(train_narrow_cases, 1, root, [("reference", ARGS, None)])[0]
    return pptp, one["reference"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_tp2_matches_single_process(runs, schedule):
    pptp, reference = runs
    # Every rank logs the same loss and gradient norm (summed over the pp, then the tp ranks).
    for r in pptp:
        assert r[schedule]["losses"] == pptp[0][schedule]["losses"]
        assert r[schedule]["grad_norms"] == pptp[0][schedule]["grad_norms"]
    assert_same_training(pptp[0][schedule], reference, grad_norm_rtol=1e-4)
