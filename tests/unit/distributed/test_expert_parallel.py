"""Expert parallel vs the plain MoE layer on gloo ranks: outputs, input, router and expert
gradients, on even and uneven routing.

Every rank builds the same seeded layer and the full batch, computes the single-process
reference, then feeds its own slice of the batch through the EP layer. The loss is a plain sum
per rank, so the summed gradients over ranks equal the reference gradient (the trainer's
local-sum / global-count loss with FSDP summing gradients, in miniature).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tests.helpers.distributed import run_distributed
from torchtitan_ablate.distributed.ep_token_dispatch import TokenDispatchExperts
from torchtitan_ablate.distributed.expert_parallel import _rank_in_expert_order, apply_ep
from torchtitan_ablate.distributed.parallel_dims import ParallelDims
from torchtitan_ablate.models.common.experts import CountReader, GroupedExperts, read_counts_with
from torchtitan_ablate.models.common.moe import MoE
from torchtitan_ablate.models.qwen3.args import qwen3_flavors
from torchtitan_ablate.models.qwen3.model import Qwen3Model

pytestmark = pytest.mark.slow  # multi-process

DIM, HIDDEN, EXPERTS, TOP_K, SEQ = 16, 8, 8, 2, 6
WEIGHTS = ("w1", "w2", "w3")
# Routing cases (one set of ranks runs them all: a spawn costs seconds):
#   balanced     the router's own choices
#   dead         experts 2 and 3 get no tokens (at EP 4: all of rank 1's, which receives nothing)
#   one_rank     every token picks experts 0 and 1: its K experts on one rank; the other ranks
#                receive nothing and experts 2-7 get no tokens
#   rank0_local  rank 0's tokens pick experts 0 and 1: rank 0 sends nothing to the other ranks
CASES = ("balanced", "dead", "one_rank", "rank0_local")
STARVED = {"balanced": 0, "dead": 2, "one_rank": 6, "rank0_local": 0}


class _OneLayer(nn.Module):
    """The minimum apply_ep walks: model.layers[*].moe."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"0": nn.Module()})
        self.layers["0"].moe = moe


def _layer_and_batch(world: int, case: str) -> tuple[MoE, torch.Tensor]:
    torch.manual_seed(3)  # a stream that starves rank 0 at world 2 and 4
    moe = MoE(DIM, HIDDEN, EXPERTS, TOP_K, use_expert_bias=True)
    moe.init_weights(0.02)
    x_BSD = torch.randn(2 * world, SEQ, DIM)
    with torch.no_grad():
        # The bias moves selection only.
        if case == "dead":
            moe.expert_bias[[2, 3]] = -10.0
        elif case == "one_rank":
            moe.expert_bias[[0, 1]] = 10.0
        elif case == "rank0_local":
            moe.router.gate.weight[[0, 1], 0] = 1.0
            x_BSD[:2, :, 0] = 30.0  # rank 0's rows
    return moe, x_BSD


def _reference(moe: MoE, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    ref = copy.deepcopy(moe)
    x_BSD = x_BSD.clone().requires_grad_()
    out_BSD = ref(x_BSD)
    target = torch.linspace(-1, 1, out_BSD.numel(), device=out_BSD.device).view_as(out_BSD)
    (out_BSD * target).sum().backward()
    grads = {n: getattr(ref.experts, n).grad for n in WEIGHTS}
    grads["router"] = ref.router.gate.weight.grad
    return out_BSD.detach(), x_BSD.grad, grads


class _RecordingReader(CountReader):
    """The default host read, also keeping the rows this rank sends."""

    def ep_splits(self, send_W, recv_WL, n_rows):
        splits = super().ep_splits(send_W, recv_WL, n_rows)
        self.sent = sum(splits[0])
        return splits

    def ep_token_splits(self, rows_W, recv_WC, n_tokens, top_k):
        splits = super().ep_token_splits(rows_W, recv_WC, n_tokens, top_k)
        self.sent = sum(splits[0])
        return splits


def _ep_rank(efsdp: int, tokens: bool = False, grouped: bool = False) -> list[dict]:
    """All routing cases on one set of ranks; one dict per case."""
    world = dist.get_world_size()
    pd = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, ep=world // efsdp, world_size=world)
    pd.build_meshes("cpu")
    return [_ep_case(pd, case, efsdp, tokens, grouped) for case in CASES]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _ep_case(
    pd: ParallelDims, case: str, efsdp: int, tokens: bool = False, grouped: bool = False
) -> dict:
    """On each rank: the EP (optionally + FSDP over efsdp) layer's results against reference,
    in float64."""
    world, rank = dist.get_world_size(), dist.get_rank()
    moe, x_BSD = _layer_and_batch(world, case)
    # The grouped GEMM (CUDA's path, forced here on CPU) takes no float64.
    dtype = torch.float32 if grouped else torch.float64
    moe, x_BSD = moe.to(dtype), x_BSD.to(dtype)
    ref_out, ref_dx, ref_grads = _reference(moe, x_BSD)
    moe.experts.force_grouped_mm = grouped or None

    apply_ep(_OneLayer(moe), pd.mesh("ep"), TokenDispatchExperts if tokens else None)
    if efsdp > 1:
        fully_shard(moe.experts, mesh=pd.mesh("efsdp"))
        # Sum gradients as the trainer does; gloo has no PREMUL_SUM, which divide factor 1.0
        # alone would ask for, so force a plain SUM.
        moe.experts.set_gradient_divide_factor(1.0)
        moe.experts.set_force_sum_reduction_for_comms(True)
    rows = slice(2 * rank, 2 * rank + 2)
    x_bSD = x_BSD[rows].clone().requires_grad_()
    reader = _RecordingReader()
    with read_counts_with(reader):
        out_bSD = moe(x_bSD)
    target = torch.linspace(-1, 1, ref_out.numel()).view_as(ref_out)[rows]
    (out_bSD * target).sum().backward()
    router_grad = moe.router.gate.weight.grad.clone()
    dist.all_reduce(router_grad)  # each rank holds its tokens' share

    # Every (token, k) row goes out once (token dispatch: every (rank, token) pair with an
    # expert there): the dispatch's one host read saw all of them.
    with torch.no_grad():
        experts_TK = moe.router(x_bSD.reshape(-1, DIM), moe.expert_bias)[2]
    dest_TK = experts_TK // (EXPERTS // pd.ep)
    distinct = sum(len(set(row.tolist())) for row in dest_TK)
    routed = distinct if tokens else experts_TK.numel()

    # Re-initialising the sharded experts gives the plain layer's initial weights.
    torch.manual_seed(1)
    moe.experts.init_weights(0.02)
    torch.manual_seed(1)
    plain = GroupedExperts(DIM, HIDDEN, EXPERTS)
    plain.init_weights(0.02)
    init_diff = max(
        (getattr(moe.experts, n).full_tensor().float() - getattr(plain, n)).abs().max().item()
        for n in WEIGHTS
    )
    w1 = moe.experts.w1
    grads = {n: _rel(getattr(moe.experts, n).grad.full_tensor(), ref_grads[n]) for n in WEIGHTS}
    grads["router"] = _rel(router_grad, ref_grads["router"])
    return {
        "case": case,
        "init": init_diff,
        "out": _rel(out_bSD.detach(), ref_out[rows]),
        "dx": _rel(x_bSD.grad, ref_dx[rows]),
        "grads": grads,
        "sent": (reader.sent, routed),
        "local_experts": w1.to_local().shape[0],
        "global_shape": tuple(w1.shape),
        "starved": sum(int(ref_grads["w1"][e].abs().sum() == 0) for e in range(EXPERTS)),
    }


def _check(results: list[list[dict]], local_experts: int, tol: float = 1e-5) -> None:
    for per_case in results:
        for case, r in zip(CASES, per_case):
            assert r["case"] == case
            assert r["out"] < tol and r["dx"] < tol and r["init"] == 0, r
            assert max(r["grads"].values()) < tol, r
            assert r["sent"][0] == r["sent"][1], r
            assert r["global_shape"][0] == EXPERTS and r["local_experts"] == local_experts
            assert r["starved"] == STARVED[case], r  # the uneven case really happened


@pytest.mark.parametrize("world", [2, 4])
def test_ep_matches_single_process(world: int) -> None:
    _check(run_distributed(_ep_rank, world, 1), EXPERTS // world)


@pytest.mark.parametrize("world", [2, 4])
def test_token_dispatch_matches_single_process(world: int) -> None:
    """Each token once per destination rank, summed there: the same outputs and gradients."""
    _check(run_distributed(_ep_rank, world, 1, True), EXPERTS // world)


@pytest.mark.parametrize("tokens", [False, True], ids=["rows", "tokens"])
def test_ep_grouped_gemm_path_on_cpu(tokens: bool) -> None:
    """CUDA's path (rows placed into padded groups, grouped GEMM), forced on CPU in float32."""
    _check(run_distributed(_ep_rank, 2, 1, tokens, True), EXPERTS // 2, tol=1e-4)


def test_ep2_with_fsdp2_over_efsdp2() -> None:
    # The resharded local tensor holds 8 / (ep 2 * efsdp 2) experts.
    _check(run_distributed(_ep_rank, 4, 2), EXPERTS // 4)


def _gpu_rank(tokens: bool) -> list[float]:
    """EP 2 on NCCL in bf16 (grouped GEMM path) against the same layer without EP."""
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    pd = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, ep=2, world_size=2)
    pd.build_meshes("cuda")
    errors = []
    for case in CASES:
        with torch.device("cuda"):
            moe, x_BSD = _layer_and_batch(2, case)
        moe, x_BSD = moe.to(torch.bfloat16), x_BSD.to(torch.bfloat16)
        ref_out, _, ref_grads = _reference(moe, x_BSD)
        apply_ep(_OneLayer(moe), pd.mesh("ep"), TokenDispatchExperts if tokens else None)
        rows = slice(2 * rank, 2 * rank + 2)
        out_bSD = moe(x_BSD[rows])
        target = torch.linspace(-1, 1, ref_out.numel(), device="cuda").view_as(ref_out)[rows]
        (out_bSD * target).sum().backward()
        pairs = [(out_bSD, ref_out[rows])]
        pairs += [(getattr(moe.experts, n).grad.full_tensor(), ref_grads[n]) for n in WEIGHTS]
        errors += [((a - b).abs().max() / b.abs().max()).item() for a, b in pairs]
    return errors


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("tokens", [False, True], ids=["rows", "tokens"])
def test_ep2_nccl_bf16_grouped_mm(tokens: bool) -> None:
    for errors in run_distributed(_gpu_rank, 2, tokens, backend="nccl"):
        assert max(errors) < 2e-2, errors  # relative to the largest entry; bf16


def _build_qwen3_moe(ep_mesh: DeviceMesh | None) -> Qwen3Model:
    with torch.device("meta"):
        model = Qwen3Model(qwen3_flavors["debugmodel_moe"])
    if ep_mesh is not None:
        apply_ep(model, ep_mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


def _meta_model_rank() -> tuple:
    world = dist.get_world_size()
    pd = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, ep=world, world_size=world)
    pd.build_meshes("cpu")
    model = _build_qwen3_moe(pd.mesh("ep"))
    plain = _build_qwen3_moe(None)
    init_diff = max(
        (getattr(m.experts, n).full_tensor() - getattr(p.experts, n)).abs().max().item()
        for m, p in zip(model.moe_layers(), plain.moe_layers())
        for n in WEIGHTS
    )
    tokens_BS = torch.randint(0, model.args.vocab_size, (1, 8))
    model(tokens_BS).float().sum().backward()
    w1 = model.layers["0"].moe.experts.w1
    shapes = tuple(w1.shape), tuple(w1.to_local().shape)
    return isinstance(w1, DTensor), shapes, w1.grad is not None, init_diff


def test_apply_ep_on_meta_qwen3_moe() -> None:
    for is_dtensor, shapes, has_grad, init_diff in run_distributed(_meta_model_rank, 2):
        assert is_dtensor and has_grad
        assert shapes[0][0] == 8 and shapes[1][0] == 4 and shapes[0][1:] == shapes[1][1:]
        assert init_diff == 0  # the same initial experts as without EP


def test_rank_in_expert_order_equals_a_stable_sort() -> None:
    """Received rows (blocks in source-major order, some empty) ranked in (local expert, source)
    order, each block keeping its row order: the stable argsort of the block keys, inverted."""
    torch.manual_seed(0)
    for _ in range(20):
        ep, n_local = 3, 4
        recv_WL = torch.randint(0, 5, (ep, n_local))
        n = int(recv_WL.sum())
        key_WL = torch.arange(n_local) * ep + torch.arange(ep)[:, None]
        order = torch.repeat_interleave(key_WL.flatten(), recv_WL.flatten()).argsort(stable=True)
        expected = torch.empty_like(order).index_put_((order,), torch.arange(n))
        assert torch.equal(_rank_in_expert_order(recv_WL, n), expected)
