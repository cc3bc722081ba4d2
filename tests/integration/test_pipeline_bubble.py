"""metrics.comm_profile under pipeline parallel: a PP 2 run on 2 gloo ranks writes the
"pipeline" entry of comm_profile.json with both pipeline ranks' measured bubbles (gathered to
rank 0 at close) next to the schedule's theoretical one, on every rank alike; a non-PP run
writes none. The debug model is untied and narrowed by tests/helpers/pipeline_runs.py."""

import json
import os

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.pipeline_runs import NARROW_ARGS, train_narrow_cases

pytestmark = pytest.mark.slow

P = "--parallelism."
# 8 sequences per step in micro-batches of 2: m = 4 per pipeline rank; 4 steps profile 2-4.
PP2 = [P + "pipeline_parallel_degree", "2", P + "pipeline_parallel_microbatch_size", "2"]
ARGS = NARROW_ARGS + ["--training.steps", "4", "--metrics.comm_profile", "true"]


def _profiles(root: str, cases: list) -> dict:
    """On every rank: train the cases, then each one's profile summary on this rank."""
    train_narrow_cases(root, cases)
    return {name: read_profile(os.path.join(root, name)) for name, _, _ in cases}


def read_profile(folder: str) -> dict | None:
    path = os.path.join(folder, "comm_profile.json")
    return json.loads(open(path).read()) if os.path.isfile(path) else None


def test_pp2_comm_profile_has_the_measured_and_theoretical_bubble(tmp_path):
    interleaved = [P + "pipeline_parallel_schedule", "Interleaved1F1B"]
    cases = [("1f1b", ARGS + PP2, None), ("interleaved", ARGS + PP2 + interleaved, None)]
    rank0, _ = run_distributed(_profiles, 2, str(tmp_path), cases, timeout_s=240)
    # p = 2, m = 4: (p - 1) / (v m + p - 1) with v = 1 and v = 2.
    expected = [("1f1b", "1F1B", 1, 1 / 5), ("interleaved", "Interleaved1F1B", 2, 1 / 9)]
    for name, schedule, v, theory in expected:
        pipe = rank0[name]["pipeline"]
        assert (pipe["schedule"], pipe["degree"], pipe["microbatches"]) == (schedule, 2, 4)
        assert pipe["stages_per_rank"] == v
        assert pipe["theoretical_bubble"] == pytest.approx(theory)
        stages = pipe["per_pp_rank"]
        assert [s["pp_rank"] for s in stages] == [0, 1] and all(s["ranks"] == 1 for s in stages)
        bubbles = [s["measured_bubble"] for s in stages]
        assert all(0 <= b <= 1 for b in bubbles)
        assert pipe["measured_bubble_max"] == max(bubbles)
        assert pipe["measured_bubble_mean"] == pytest.approx(sum(bubbles) / 2)
        assert all(s["peak_active_gib"] is None for s in stages)  # CPU: no allocator peak
        # Rank 0's own shares stay as without PP: its bubble is 1 - its compute share.
        assert bubbles[0] == pytest.approx(1 - rank0[name]["compute_share"])
