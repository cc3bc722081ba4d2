"""Every data-parallel layout on 2 and 4 gloo ranks trains like the one-process run (fp32):
per-step losses within 1e-5 relative, final parameters within 1e-4 (TP x CP and MoE x TP:
gradient norms within 1e-4 relative too; MoE x TP: the logged expert loads equal)."""

import functools
import tempfile

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_harness import assert_same_training, train_layout

pytestmark = pytest.mark.slow

P = "--parallelism."
AC = "--activation_checkpoint.mode"
# The MoE aux loss is computed per rank and micro-batch (as HF and Megatron do by default), so
# it legitimately differs between layouts; everything else must match.
EXTRA = ["--model.moe_aux_loss_coef", "0"]


@functools.cache
def reference(flavor: str) -> dict:
    """The one-process run, computed once per flavor for the whole module."""
    tmp = tempfile.mkdtemp(prefix=f"ref_{flavor}_")
    return run_distributed(train_layout, 1, tmp, ["--model.flavor", flavor] + EXTRA)[0]


LAYOUTS = {
    "fsdp2_default": (2, []),
    "fsdp2_always": (2, [P + "fsdp_reshard_after_forward", "always"]),
    "fsdp2_never_zero2": (2, [P + "fsdp_reshard_after_forward", "never"]),
    "fsdp4": (4, []),
    "replicate2": (2, [P + "data_parallel_replicate_degree", "2"]),
    "hsdp2x2": (4, [P + "data_parallel_replicate_degree", "2"]),
    "fsdp2_ac_full": (2, ["--activation_checkpoint.mode", "full"]),
    "fsdp2_ac_selective_2": (2, ["--activation_checkpoint.mode", "selective"]),
    "cp2": (2, [P + "context_parallel_degree", "2"]),
    "cp2_fsdp2": (4, [P + "context_parallel_degree", "2"]),
    "cp2_ac_selective_op": (
        2,
        [P + "context_parallel_degree", "2", "--activation_checkpoint.mode", "selective"]
        + ["--activation_checkpoint.selective_ac_option", "op"],
    ),
    "hsdp2x2_ac_full": (4, [P + "data_parallel_replicate_degree", "2", AC, "full"]),
    "ep2_ac_selective_2": (2, [P + "expert_parallel_degree", "2", AC, "selective"]),
    "fsdp2_chunked_loss": (2, ["--training.loss_chunk_size", "100"]),
    "ep2": (2, [P + "expert_parallel_degree", "2"]),
    "ep4": (4, [P + "expert_parallel_degree", "4"]),
    "ep2_efsdp2": (4, [P + "expert_parallel_degree", "2"]),
    # Token dispatch, over efsdp 2 and under full AC (its recompute repeats the dispatch).
    "ep2_efsdp2_tokens_ac_full": (
        4,
        [P + "expert_parallel_degree", "2", P + "expert_parallel_dispatch", "tokens"]
        + [AC, "full"],
    ),
    "hsdp2x2_ep2": (
        4,
        [P + "data_parallel_replicate_degree", "2", P + "expert_parallel_degree", "2"],
    ),
    "ep2_ac_full": (2, [P + "expert_parallel_degree", "2", "--activation_checkpoint.mode", "full"]),
    # Tensor parallel: alone, as a 2-D layout under FSDP and inside CP (dense and MoE: its MoE
    # layers route each tp rank's tokens, experts sharded over dp_shard * cp * tp); MoE: with
    # EP too.
    "tp2": (2, [P + "tensor_parallel_degree", "2"]),
    "tp2_fsdp2": (4, [P + "tensor_parallel_degree", "2"]),
    "tp2_ep2": (4, [P + "tensor_parallel_degree", "2", P + "expert_parallel_degree", "2"]),
    # TP inside CP: each cp rank's zigzag slice is split again over tp (sequence parallel).
    "tp2_cp2": (4, [P + "tensor_parallel_degree", "2", P + "context_parallel_degree", "2"]),
    "fsdp2_ac_selective_op": (
        2,
        [
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
        ],
    ),
}


# Layouts whose code differs between dense and MoE run on both; EP needs MoE; the rest run
# on the dense model (MoE adds nothing to those paths and doubles the suite's time).
BOTH = {"fsdp2_default", "hsdp2x2", "cp2_fsdp2", "fsdp2_ac_full", "tp2", "tp2_fsdp2", "tp2_cp2"}
NORM_CHECKED = {"tp2_cp2", "tp2_ep2"}
CASES = [
    (layout, flavor)
    for layout, (_, args) in LAYOUTS.items()
    for flavor in ("debugmodel", "debugmodel_moe")
    if (flavor == "debugmodel_moe") == ("expert_parallel_degree" in " ".join(args))
    or layout in BOTH
]


@pytest.mark.parametrize("layout, flavor", CASES)
def test_layout_matches_single_process(tmp_path_factory, layout, flavor):
    world, args = LAYOUTS[layout]
    ref = reference(flavor)
    out = run_distributed(
        train_layout,
        world,
        str(tmp_path_factory.mktemp(layout)),
        ["--model.flavor", flavor] + EXTRA + args,
    )
    got = dict(out[0])
    assert all(o["losses"] == out[0]["losses"] for o in out)  # every rank logs the same loss
    # The gradient norm (clipping) over TP's DTensors sharded over dp_shard * cp too. 1e-4:
    # one process's fp32 norm is itself 2e-5 off the float64 norm of the same gradients.
    moe_tp = flavor == "debugmodel_moe" and layout.startswith("tp")
    norm_rtol = 1e-4 if layout in NORM_CHECKED or moe_tp else None
    assert_same_training(got, ref, grad_norm_rtol=norm_rtol)
    if moe_tp:  # the tp ranks' routing counts are summed like the dp ranks'
        assert got["load"] == ref["load"]


def test_moe_tp_aux_loss_is_the_mean_over_tp_ranks(tmp_path):
    """Each tp rank's aux loss covers its own S / tp tokens (as each dp / cp rank's covers its
    own), so the logged value (and the gradient's weight) is their mean: close to the one
    process's over whole sequences, not tp times it."""
    args = ["--model.flavor", "debugmodel_moe", "--training.steps", "2"]
    ref = run_distributed(train_layout, 1, str(tmp_path / "ref"), args)[0]
    tp = [P + "tensor_parallel_degree", "2"]
    got = run_distributed(train_layout, 2, str(tmp_path / "tp"), args + tp)[0]
    for a, b in zip(got["aux"], ref["aux"], strict=True):
        assert abs(a - b) <= 0.01 * b, (got["aux"], ref["aux"])


def test_expert_bias_balancing_matches_single_process(tmp_path):
    """Aux-loss-free balancing uses each step's load summed over ranks, so EP 2 x FSDP and one
    process move the expert bias (and everything else) identically."""
    args = ["--model.flavor", "debugmodel_moe", "--model.moe_bias_update_rate", "1e-2"] + EXTRA
    ref = run_distributed(train_layout, 1, str(tmp_path / "ref"), args)[0]
    ep = [P + "expert_parallel_degree", "2"]
    got = run_distributed(train_layout, 4, str(tmp_path / "ep"), args + ep)[0]
    bias = ref["params"]["layers.0.moe.expert_bias"]
    assert bias.abs().sum() > 0  # the bias moved
    assert_same_training(got, ref)  # compares the bias buffers too
