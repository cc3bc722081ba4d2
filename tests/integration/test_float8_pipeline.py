"""float8 (tensorwise) x pipeline parallel 2 (1F1B) on gloo ranks trains like the one-process
float8 run, with the debug model narrowed and untied (tests/helpers/pipeline_runs.py).

Each pipeline micro-batch scales its activations by its own amax where one process scales the
whole batch's, so float8 rounds a few elements differently: the runs agree to float8's
rounding, not to fp32's. Tolerances, measured on CPU (torch 2.13):
- step 1, same weights: loss within 5e-5 relative (measured 8.4e-6); gradient norm within
  1e-4 (measured 3.1e-5).
- later steps: loss within 5e-4 relative (measured 2.7e-5).
- final weights: relative L2 distance within 5e-3 (measured 6.3e-4).
At this width float8 moves training by as little (fp32 vs float8: 1.0e-5 on the step-1 loss,
5.8e-4 on the weights), so the figures cannot tell a part left in high precision: the test
counts the Linear modules each pipeline rank converted instead.
"""

import logging
import re

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.float8_checks import assert_float8_trains_like
from tests.helpers.pipeline_runs import train_narrow_cases

pytestmark = pytest.mark.slow

P = "--parallelism."
ARGS = ["--training.steps", "3", "--training.seq_len", "32", "--model.n_layers", "4"]
ARGS += ["--metrics.log_freq", "1"]
FLOAT8 = ["--float8.enable", "true", "--float8.recipe", "tensorwise"]
PP2 = [P + "pipeline_parallel_degree", "2", P + "pipeline_parallel_microbatch_size", "2"]


def _train_counting_float8(root: str, case: tuple) -> tuple[dict, int]:
    """The case's figures on this rank, and how many Linear modules it converted to float8."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("torchtitan_ablate")
    log.addHandler(handler)
    log.setLevel(logging.INFO)  # a rank process: its own logger, restored by nothing
    out = train_narrow_cases(root, [case])[case[0]]
    converted = sum(int(m[1]) for x in lines if (m := re.match(r"float8: (\d+) Linear", x)))
    return out, converted


def test_float8_pp2_matches_single_process(tmp_path):
    case = ("float8", ARGS + FLOAT8, None)
    ref, converted = run_distributed(_train_counting_float8, 1, str(tmp_path), case)[0]
    pp = ("pp2", ARGS + FLOAT8 + PP2, None)
    ranks = run_distributed(_train_counting_float8, 2, str(tmp_path), pp, timeout_s=300)
    assert converted > 0 and sum(n for _, n in ranks) == converted  # each part its own linears
    got = ranks[0][0]
    assert ranks[1][0]["losses"] == got["losses"]  # every pipeline rank logs the same loss
    assert_float8_trains_like(got, ref, loss1=5e-5, weights=5e-3)
