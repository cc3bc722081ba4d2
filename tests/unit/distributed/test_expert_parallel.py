"""Every dispatcher with every local compute against the plain one-process MoE layer, on gloo
ranks: outputs, input, router, expert and adapter gradients, on even and uneven routing.

    dispatch  none (LocalDispatch), rows (RowDispatch), tokens (TokenDispatch)
    compute   grouped (torch._grouped_mm forced on CPU, float32: it takes no float64), loop
              (float64), lora_grouped, lora_loop (the same with adapters on the experts)

Every rank builds the same seeded layer and the full batch, computes the reference (the plain
layer in float64 on the loop; with adapters, the plain layer with expert weights W + scale * B A,
the function LoRA computes, its weight gradients carried to A and B by the chain rule), then feeds
its own slice of the batch through the layer under test. The loss is a plain sum per rank, so
the summed gradients over ranks equal the reference gradient (the trainer's local-sum /
global-count loss with FSDP summing gradients, in miniature).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tests.helpers.distributed import run_distributed
from torchtitan_ablate.distributed.ep_token_dispatch import TokenDispatch
from torchtitan_ablate.distributed.expert_parallel import RowDispatch, apply_ep
from torchtitan_ablate.distributed.parallel_dims import ParallelDims
from torchtitan_ablate.models.common.experts import CountReader, GroupedExperts, read_counts_with
from torchtitan_ablate.models.common.lora import adapters_off, apply_lora
from torchtitan_ablate.models.common.moe import MoE

pytestmark = pytest.mark.slow  # multi-process

DIM, HIDDEN, EXPERTS, TOP_K, SEQ = 16, 8, 8, 2, 6
RANK, ALPHA = 3, 6.0  # rank 3: the grouped GEMM's adapters take the rank padding
WEIGHTS = ("w1", "w2", "w3")
DISPATCH = {"none": None, "rows": RowDispatch, "tokens": TokenDispatch}
COMPUTE = ("grouped", "loop", "lora_grouped", "lora_loop")
PAIRS = [(d, c) for d in DISPATCH for c in COMPUTE]
# Routing cases (one set of ranks runs them all: a spawn costs seconds):
#   balanced     the router's own choices
#   dead         experts 2 and 3 get no tokens (at EP 4: all of rank 1's, which receives nothing)
#   one_rank     every token picks experts 0 and 1: its K experts on one rank; the other ranks
#                receive nothing and experts 2-7 get no tokens
#   rank0_local  rank 0's tokens pick experts 0 and 1: rank 0 sends nothing to the other ranks
CASES = ("balanced", "dead", "one_rank", "rank0_local")
STARVED = {"balanced": 0, "dead": 2, "one_rank": 6, "rank0_local": 0}


class _OneLayer(nn.Module):
    """The minimum apply_ep and apply_lora walk: model.layers[*].moe."""

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


def _with_compute(moe: MoE, x_BSD: torch.Tensor, compute: str) -> tuple[MoE, torch.Tensor]:
    """The layer in the compute's dtype and path, with seeded adapters for lora_*."""
    grouped = compute.endswith("grouped")
    dtype = torch.float32 if grouped else torch.float64
    moe, x_BSD = moe.to(dtype), x_BSD.to(dtype)
    moe.experts.force_grouped_mm = grouped
    if compute.startswith("lora"):
        apply_lora(_OneLayer(moe), RANK, ALPHA, 0.0, ["experts"])
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, p in moe.experts.named_parameters():
                if name.startswith("lora_"):  # B != 0, or the adapters would do nothing
                    p.copy_(0.2 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return moe, x_BSD


def _plain_float64(moe: MoE, merged: bool) -> MoE:
    """moe without adapters in float64 on the loop; merged: expert weights W + scale * B A."""
    ref = copy.deepcopy(moe).double()
    experts = ref.experts
    ref.experts = GroupedExperts(DIM, HIDDEN, EXPERTS, grouped_mm=False).double()
    with torch.no_grad():
        for n in WEIGHTS:
            w = getattr(experts, n)
            if merged and experts.adapters is not None:
                a, b = getattr(experts, f"lora_a_{n}"), getattr(experts, f"lora_b_{n}")
                w = w + experts.adapters.scale * (b @ a)
            getattr(ref.experts, n).copy_(w)
    return ref.requires_grad_(True)


def _target(n: int) -> torch.Tensor:
    return torch.linspace(-1, 1, n, dtype=torch.float64)


def _reference(moe: MoE, x_BSD: torch.Tensor) -> dict:
    ref = _plain_float64(moe, merged=True)
    x_BSD = x_BSD.double().clone().requires_grad_()
    out_BSD = ref(x_BSD)
    (out_BSD * _target(out_BSD.numel()).view_as(out_BSD)).sum().backward()
    g = {n: getattr(ref.experts, n).grad for n in WEIGHTS}
    result = {"out": out_BSD.detach(), "dx": x_BSD.grad, "starved": g["w1"]}
    adapters = moe.experts.adapters
    if adapters is None:
        result["grads"] = {**g, "router": ref.router.gate.weight.grad}
        return result
    # W_eff = W + s * B A: dL/dA = s * B^T G, dL/dB = s * G A^T; base and router are frozen.
    grads = {}
    for n in WEIGHTS:
        a_ErN = getattr(moe.experts, f"lora_a_{n}").double()
        b_EOr = getattr(moe.experts, f"lora_b_{n}").double()
        grads[f"lora_a_{n}"] = adapters.scale * b_EOr.transpose(1, 2) @ g[n]
        grads[f"lora_b_{n}"] = adapters.scale * g[n] @ a_ErN.transpose(1, 2)
    result["grads"] = grads
    with torch.no_grad():
        result["off"] = _plain_float64(moe, merged=False)(x_BSD)
    return result


class _RecordingReader(CountReader):
    """The default host read, also keeping the rows this rank sends."""

    sent = 0

    def ep_splits(self, send_W, recv_WL, n_rows):
        splits = super().ep_splits(send_W, recv_WL, n_rows)
        self.sent = sum(splits[0])
        return splits

    def ep_token_splits(self, rows_W, recv_WC, n_tokens, top_k):
        splits = super().ep_token_splits(rows_W, recv_WC, n_tokens, top_k)
        self.sent = sum(splits[0])
        return splits


def _pairs_rank(pairs: list[tuple[str, str]], efsdp: int) -> list[dict]:
    """Every pair and routing case on one set of ranks; one dict each."""
    world = dist.get_world_size()
    pd = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, ep=world // efsdp, world_size=world)
    pd.build_meshes("cpu")
    return [_run(pd, d, c, case, efsdp) for d, c in pairs for case in CASES]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).abs().max() / b.abs().max()).item()


def _full(grad: torch.Tensor, spread: bool) -> torch.Tensor:
    """The whole gradient: gathered from the ep shards, or summed over ranks (spread)."""
    if isinstance(grad, DTensor):
        return grad.full_tensor()
    grad = grad.clone()
    if spread:
        dist.all_reduce(grad)  # each rank holds its tokens' share
    return grad


def _run(pd: ParallelDims, dispatch: str, compute: str, case: str, efsdp: int) -> dict:
    """On each rank: the layer under test (EP over pd's ep mesh unless dispatch is none,
    optionally + FSDP over efsdp) against the reference."""
    world, rank = dist.get_world_size(), dist.get_rank()
    moe, x_BSD = _with_compute(*_layer_and_batch(world, case), compute)
    ref = _reference(moe, x_BSD)
    ep = DISPATCH[dispatch] is not None
    if ep:
        apply_ep(_OneLayer(moe), pd.mesh("ep"), DISPATCH[dispatch])
    if efsdp > 1:
        fully_shard(moe.experts, mesh=pd.mesh("efsdp"))
        # Sum gradients as the trainer does; gloo has no PREMUL_SUM, which divide factor 1.0
        # alone would ask for, so force a plain SUM.
        moe.experts.set_gradient_divide_factor(1.0)
        moe.experts.set_force_sum_reduction_for_comms(True)
    rows = slice(2 * rank, 2 * rank + 2)
    x_bSD = x_BSD[rows].clone().requires_grad_()
    off = None
    if "off" in ref:  # DPO's reference pass: every adapter off, EP or not
        with torch.no_grad(), adapters_off(moe):
            off = _rel(moe(x_bSD), ref["off"][rows])
    reader = _RecordingReader()
    with read_counts_with(reader):
        out_bSD = moe(x_bSD)
    target = _target(ref["out"].numel()).view_as(ref["out"])[rows].to(out_bSD.dtype)
    (out_bSD * target).sum().backward()
    params = dict(moe.experts.named_parameters()) | {"router": moe.router.gate.weight}
    grads = {n: _rel(_full(params[n].grad, n == "router" or not ep), g)
             for n, g in ref["grads"].items()}  # fmt: skip
    result = {
        "pair": (dispatch, compute, case),
        "out": _rel(out_bSD.detach(), ref["out"][rows]),
        "dx": _rel(x_bSD.grad, ref["dx"][rows]),
        "grads": grads,
        "starved": sum(int(ref["starved"][e].abs().sum() == 0) for e in range(EXPERTS)),
        "tol": 1e-4 if compute.endswith("grouped") else 1e-5,
    }
    if off is not None:
        result["off"] = off
    if ep:
        result |= _ep_facts(moe, x_bSD, pd.ep, reader.sent, dispatch == "tokens")
    return result


def _ep_facts(moe: MoE, x_bSD: torch.Tensor, ep: int, sent: int, tokens: bool) -> dict:
    # Every (token, k) row goes out once (token dispatch: every (rank, token) pair with an
    # expert there): the dispatch's one host read saw all of them.
    with torch.no_grad():
        experts_TK = moe.router(x_bSD.reshape(-1, DIM), moe.expert_bias)[2]
    dest_TK = experts_TK // (EXPERTS // ep)
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
    lora = [p for n, p in moe.experts.named_parameters() if n.startswith("lora_")]
    return {
        "init": init_diff,
        "sent": (sent, routed),
        "local_experts": {p.to_local().shape[0] for p in [w1, *lora]},
        "global_shape": tuple(w1.shape),
    }


def _check(results: list[list[dict]], pairs: list[tuple[str, str]], local_experts: int) -> None:
    for per_rank in results:
        assert [r["pair"] for r in per_rank] == [(d, c, case) for d, c in pairs for case in CASES]
        for r in per_rank:
            tol, case = r["tol"], r["pair"][2]
            assert r["out"] < tol and r["dx"] < tol, r
            assert r["grads"] and max(r["grads"].values()) < tol, r
            assert r.get("off", 0) < tol, r
            assert r["starved"] == STARVED[case], r  # the uneven case really happened
            if "sent" in r:
                assert r["init"] == 0 and r["sent"][0] == r["sent"][1], r
                assert r["global_shape"][0] == EXPERTS, r
                assert r["local_experts"] == {local_experts}, r  # adapters sharded like weights


@pytest.mark.parametrize("world", [2, 4])
def test_every_dispatcher_with_every_compute_matches_single_process(world: int) -> None:
    """{none, rows, tokens} x {grouped, loop, lora_grouped, lora_loop}, every routing case."""
    _check(run_distributed(_pairs_rank, world, PAIRS, 1), PAIRS, EXPERTS // world)


def test_ep2_with_fsdp2_over_efsdp2() -> None:
    # The resharded local tensor holds 8 / (ep 2 * efsdp 2) experts (adapters alike).
    pairs = [("rows", "loop"), ("tokens", "lora_loop"), ("rows", "lora_grouped")]
    _check(run_distributed(_pairs_rank, 4, pairs, 2), pairs, EXPERTS // 4)


def _gpu_rank(dispatch: str, lora: bool) -> list[float]:
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
        if lora:
            apply_lora(_OneLayer(moe), 4, 8.0, 0.0, ["experts"])
            with torch.no_grad():
                for name, p in moe.experts.named_parameters():
                    if name.startswith("lora_"):
                        p.normal_(0, 0.2)
        ref = copy.deepcopy(moe)
        ref_out = ref(x_BSD)
        target = torch.linspace(-1, 1, ref_out.numel(), device="cuda").view_as(ref_out)
        (ref_out * target).sum().backward()
        apply_ep(_OneLayer(moe), pd.mesh("ep"), DISPATCH[dispatch])
        rows = slice(2 * rank, 2 * rank + 2)
        out_bSD = moe(x_BSD[rows])
        (out_bSD * target[rows]).sum().backward()
        pairs = [(out_bSD, ref_out[rows])]
        for n, p in ref.experts.named_parameters():
            if p.grad is not None:
                pairs.append((moe.experts.get_parameter(n).grad.full_tensor(), p.grad))
        assert len(pairs) == 1 + (6 if lora else 3)  # the output, then the trained tensors
        errors += [((a - b).abs().max() / b.abs().max()).item() for a, b in pairs]
    return errors


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("dispatch", ["rows", "tokens"])
def test_ep2_nccl_bf16_grouped_mm(dispatch: str, lora: bool) -> None:
    for errors in run_distributed(_gpu_rank, 2, dispatch, lora, backend="nccl"):
        assert max(errors) < 2e-2, errors  # relative to the largest entry; bf16
