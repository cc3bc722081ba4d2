"""Pipeline parallel with context parallel on gloo ranks trains like the one-process run (fp32):
PP 2 x CP 2 on 4 ranks, per-step losses within 1e-5 relative, gradient norms within 1e-4
relative, final parameters within 1e-4; validation (the schedule's eval after every step) gives
the held-out losses within 1e-5, the same on every rank.

Each part's attention gathers K/V over its own cp group, builds its own CP mask, and the
pipeline's boundaries carry each cp rank's slice (seq_len / cp tokens); labels are sliced the
same way as the inputs. A wrong boundary shape fails the first step; a part without its CP mask
or a label slice misaligned with the inputs moves the losses far past 1e-5. Two schedules:
1F1B (one part per rank) and Interleaved1F1B (two parts per rank, whose collectives interleave
with the other part's). One 4-rank group trains both in turn; one process the reference. The
debug model is untied and narrowed to dim 64 (tests/helpers/pipeline_runs.py).
"""

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_harness import assert_same_training
from tests.helpers.pipeline_runs import NARROW_ARGS, VAL, Case, pp2_with, train_narrow_cases

pytestmark = pytest.mark.slow

P = "--parallelism."
# Three steps of 8 sequences of 32 tokens, in micro-batches of 2: each cp rank holds 16 tokens
# of each sequence (two zigzag chunks of 8).
ARGS = NARROW_ARGS
PP2_CP2 = pp2_with("context_parallel_degree")
SCHEDULES = ("1F1B", "Interleaved1F1B")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], dict]:
    """Every rank's results of the PP 2 x CP 2 group, and the one-process reference."""
    root = str(tmp_path_factory.mktemp("ppcp"))
    cases: list[Case] = [
        (s, ARGS + VAL + PP2_CP2 + [P + "pipeline_parallel_schedule", s], None) for s in SCHEDULES
    ]
    ppcp = run_distributed(train_narrow_cases, 4, root, cases, timeout_s=300)
    one = run_distributed(train_narrow_cases, 1, root, [("reference", ARGS + VAL, None)])[0]
    return ppcp, one["reference"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_cp2_matches_single_process(runs, schedule):
    ppcp, reference = runs
    # Every rank logs the same loss (summed over the pp ranks, then the cp ranks).
    for key in ("losses", "validation"):
        assert all(r[schedule][key] == ppcp[0][schedule][key] for r in ppcp)
    assert_same_training(ppcp[0][schedule], reference, grad_norm_rtol=1e-4)
