"""Pipeline parallel with the MoE model on gloo ranks trains like the one-process run (fp32):
per-step losses, final weights (the expert bias included) and the logged per-layer expert load
as the reference, for a one-stage-per-rank schedule (1F1B) and a two-stage one (ZBVZeroBubble:
rank 0 holds the first and last stages, so its MoE layers are not contiguous).

The aux loss is off here: each pipeline micro-batch's aux loss is its own (as with gradient
accumulation), so its gradient differs from the one-process run's whole-batch aux loss. The
aux-loss-free bias is on (moe_bias_update_rate), moved by the step's global expert load.
"""

import os
from dataclasses import replace

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_harness import assert_same_training, train_layout
from torchtitan_ablate.models.qwen3 import qwen3_flavors

pytestmark = pytest.mark.slow

P = "--parallelism."
ARGS = [
    "--model.flavor", "debugmodel_moe", "--model.n_layers", "4", "--training.steps", "3",
    "--training.seq_len", "32", "--metrics.log_freq", "1",
    "--model.moe_aux_loss_coef", "0", "--model.moe_bias_update_rate", "1e-3",
]  # fmt: skip
PP2 = [P + "pipeline_parallel_degree", "2", P + "pipeline_parallel_microbatch_size", "2"]
SCHEDULES = ("1F1B", "ZBVZeroBubble")


def _runs(root: str, cases: list[tuple[str, list[str]]]) -> dict:
    moe = qwen3_flavors["debugmodel_moe"]
    narrow = dict(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128, moe_hidden_dim=32)
    qwen3_flavors["debugmodel_moe"] = replace(moe, tie_embeddings=False, **narrow)
    return {name: train_layout(os.path.join(root, name), args) for name, args in cases}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], dict]:
    root = str(tmp_path_factory.mktemp("pp_moe"))
    cases = [(s, ARGS + PP2 + [P + "pipeline_parallel_schedule", s]) for s in SCHEDULES]
    pp2 = run_distributed(_runs, 2, root, cases, timeout_s=300)
    one = run_distributed(_runs, 1, root, [("reference", ARGS)])[0]
    return pp2, one


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_moe_matches_single_process(runs, schedule):
    pp2, one = runs
    ref = one["reference"]
    assert pp2[0][schedule]["losses"] == pp2[1][schedule]["losses"]
    # Every layer's load, gathered over the pp ranks in layer order, on every rank.
    assert len(ref["load"][0]) == 4
    for rank in (0, 1):
        for got, want in zip(pp2[rank][schedule]["load"], ref["load"], strict=True):
            assert got == pytest.approx(want, rel=1e-3)
    assert any("expert_bias" in k for k in ref["params"])
    assert_same_training(pp2[0][schedule], ref)
