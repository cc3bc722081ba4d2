"""Pipeline parallel with the MoE model on gloo ranks trains like the one-process run (fp32):
per-step losses, final weights (the expert bias included) and the logged per-layer expert load
as the reference, for a one-stage-per-rank schedule (1F1B) and a two-stage one (ZBVZeroBubble:
rank 0 holds the first and last stages, so its MoE layers are not contiguous); on 2 ranks (PP 2)
and on 4 with expert parallel (PP 2 x EP 2: each part's experts split over the 2 ranks of its
pp slice, which run the same schedule, so their all-to-alls pair up) or tensor parallel (PP 2 x
TP 2: each tp rank's MoE layers route its own half of every micro-batch's sequences, its
experts whole and sharded by FSDP over the stage's 2 tp ranks, the router's gate a replicated
DTensor whose gradient FSDP sums over them; the expert load and the bias update sum the tp
ranks' loads), and on 8 with both (PP 2 x TP 2 x EP 2, ZBVZeroBubble). A PP 2 x TP 2
ZBVZeroBubble checkpoint (experts on their own FSDP mesh, the gate replicated) resumes on one
process like the uninterrupted run.

The aux loss is off against one process: each pipeline micro-batch's aux loss is its own (as
with gradient accumulation; under TP each tp rank's covers its own tokens), so its gradient
differs from the one-process run's whole-batch aux loss. With it on, PP 2 x EP 2 trains like
PP 2 alone: the same micro-batches, each weighing 1 / (micro-batches x dp). The aux-loss-free
bias is on (moe_bias_update_rate), moved by the step's global expert load. Every run validates
after each step (the schedule's eval: the held-out loss as the reference's, without the aux
loss). max_norm is below the gradient norms (about 0.7), so every step clips by the norm over
every part and expert shard; the norms are compared too.
"""

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_harness import assert_same_training
from tests.helpers.pipeline_runs import VAL, Case, train_narrow_cases

pytestmark = pytest.mark.slow

P = "--parallelism."
ARGS = [
    "--model.flavor", "debugmodel_moe", "--model.n_layers", "4", "--training.steps", "3",
    "--training.seq_len", "32", "--metrics.log_freq", "1",
    "--model.moe_aux_loss_coef", "0", "--model.moe_bias_update_rate", "1e-3",
    "--training.max_norm", "0.5", *VAL,
]  # fmt: skip
AUX = ["--model.moe_aux_loss_coef", "1e-2"]
# Steps too small to move an fp32 weight: the initial weights stay (the expert bias moves).
FROZEN = ["--optimizer.lr", "1e-30"]
PP2 = [P + "pipeline_parallel_degree", "2", P + "pipeline_parallel_microbatch_size", "2"]
SCHEDULES = ("1F1B", "ZBVZeroBubble")
# pp 2 x dp_shard 2 (EP borrows its ranks): 4 of the 8 sequences per dp rank. FSDP is on: under
# PP its default keeps the weights gathered from forward to backward (ZBVZeroBubble needs it).
EP2 = [P + "expert_parallel_degree", "2", "--training.local_batch_size", "4"]
TP2 = [P + "tensor_parallel_degree", "2"]  # the 8 sequences on each pp rank, 16 tokens per tp rank
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "1"]


def _schedule(s: str) -> list[str]:
    return ARGS + PP2 + [P + "pipeline_parallel_schedule", s]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("pp_moe"))


@pytest.fixture(scope="module")
def one(root) -> dict:
    return run_distributed(train_narrow_cases, 1, root, [("reference", ARGS, None)])[0]["reference"]


@pytest.fixture(scope="module")
def pp2(root) -> list[dict]:
    cases: list[Case] = [(s, _schedule(s), None) for s in SCHEDULES]
    cases += [("aux", _schedule("1F1B") + AUX, None)]
    frozen = (("", []), ("_aux", AUX))
    cases += [(f"frozen{a}", _schedule("1F1B") + FROZEN + x, None) for a, x in frozen]
    return run_distributed(train_narrow_cases, 2, root, cases, timeout_s=300)


@pytest.fixture(scope="module")
def four(root) -> list[dict]:
    """The 4-rank runs, PP 2 x EP 2 and PP 2 x TP 2, in one group (the ZBVZeroBubble one saves
    a checkpoint after every step: its figures are the uninterrupted run's)."""
    cases: list[Case] = [(f"ep2_{s}", _schedule(s) + EP2, None) for s in SCHEDULES]
    cases += [("ep2_aux", _schedule("1F1B") + EP2 + AUX, None)]
    cases += [("tp2_1F1B", _schedule("1F1B") + TP2, None)]
    cases += [("tp2_ZBVZeroBubble", _schedule("ZBVZeroBubble") + TP2 + CKPT, None)]
    return run_distributed(train_narrow_cases, 4, root, cases, timeout_s=300)


@pytest.fixture(scope="module")
def eight(root) -> list[dict]:
    """PP 2 x TP 2 x EP 2: each stage's 4 ranks split the experts over the ep pairs of one tp
    coordinate, FSDP-sharding them over the 2 tp ranks; two parts per rank."""
    case = ("tp2_ep2", _schedule("ZBVZeroBubble") + TP2 + EP2, None)
    return run_distributed(train_narrow_cases, 8, root, [case], timeout_s=300)


@pytest.fixture(scope="module")
def tp2_resumed(root, four) -> dict:
    case = ("tp2_one", ARGS + CKPT, "tp2_ZBVZeroBubble")
    return run_distributed(train_narrow_cases, 1, root, [case])[0]["tp2_one"]


def _assert_matches(ranks: list[dict], name: str, ref: dict) -> None:
    for key in ("losses", "validation"):
        assert all(r[name][key] == ranks[0][name][key] for r in ranks)
    # Every layer's load, summed over the dp ranks and gathered over the pp ranks in layer
    # order, on every rank (logged rounded to 3 digits: rel 1e-3).
    assert len(ref["load"][0]) == 4
    for r in ranks:
        for got, want in zip(r[name]["load"], ref["load"], strict=True):
            assert got == pytest.approx(want, rel=1e-3)
    assert any("expert_bias" in k for k in ref["params"])
    assert_same_training(ranks[0][name], ref)
    _assert_same_norms(ranks[0][name], ref)


def _assert_same_norms(got: dict, want: dict) -> None:
    # The norm before clipping: 1e-4, as the gradients' sum over 2 dp ranks alone (FSDP 2, no
    # PP) moves it by 1.3e-5 from one process's; a missed part or expert shard moves it by %.
    assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=1e-4)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_moe_matches_single_process(pp2, one, schedule):
    _assert_matches(pp2, schedule, one)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_ep2_moe_matches_single_process(four, one, schedule):
    _assert_matches(four, f"ep2_{schedule}", one)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_tp2_moe_matches_single_process(four, one, schedule):
    _assert_matches(four, f"tp2_{schedule}", one)


def test_pp2_tp2_ep2_moe_matches_single_process(eight, one):
    _assert_matches(eight, "tp2_ep2", one)


def test_pp2_tp2_moe_checkpoint_resumes_on_one_process(four, tp2_resumed):
    """Each rank saves its parts' tp shards, its FSDP shard of the experts (over the stage's
    tp ranks) and the replicated gate under the whole model's names."""
    whole = four[0]["tp2_ZBVZeroBubble"]
    after_step1 = {k: whole[k][1:] for k in ("losses", "validation")} | {"params": whole["params"]}
    assert_same_training(tp2_resumed, after_step1)


def test_pp2_ep2_aux_loss_matches_pp2(pp2, four):
    # Rows 2k and 2k + 1 form micro-batch k in both layouts (dp rank 1 reads rows 4 to 7).
    got, want = four[0]["ep2_aux"], pp2[0]["aux"]
    assert_same_training(got, want)
    _assert_same_norms(got, want)


def test_pp2_moe_validation_leaves_the_aux_loss_out(pp2):
    """The aux loss rides on the gradient only: with the weights kept (lr 1e-30), the held-out loss
    is the same with it on or off, and the logged aux loss is the training forwards'."""
    got, want = pp2[0]["frozen_aux"], pp2[0]["frozen"]
    assert got["validation"] == want["validation"] and None not in got["validation"]
    assert all(a > 0 for a in got["aux"]) and want["aux"] == [0.0] * 3
