"""Routing: forced round-robin balance (debug.moe_force_load_balance) against torchtitan's
round-robin counts and a per-token reference, under expert parallel and compile; the centred
expert-bias update against torchtitan's rule; the init that keeps the first routers' inputs
token-specific (dev/routing_study.md)."""

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.helpers.distributed import run_distributed
from tests.helpers.estimator_checks import assert_estimate_matches_ranks
from torchtitan_ablate.config import load_config
from torchtitan_ablate.distributed.ep_token_dispatch import TokenDispatch
from torchtitan_ablate.distributed.expert_parallel import RowDispatch, apply_ep
from torchtitan_ablate.distributed.parallel_dims import ParallelDims
from torchtitan_ablate.estimator import estimate
from torchtitan_ablate.estimator.routing import round_robin_reach
from torchtitan_ablate.models.common.experts import CountReader, read_counts_with
from torchtitan_ablate.models.common.moe import MoE, TopKRouter, round_robin_expert
from torchtitan_ablate.models.qwen3 import Qwen3Model, qwen3_flavors

SHAPES = [(128, 8), (8, 2), (12, 8), (10, 3), (7, 7), (64, 6)]  # (experts, top_k)


def forced_router(n_experts: int, top_k: int, dim: int = 16) -> TopKRouter:
    torch.manual_seed(0)
    router = TopKRouter(dim, n_experts, top_k, norm_topk_prob=True, force_load_balance=True)
    nn.init.normal_(router.gate.weight, 0, 0.5)
    return router


@pytest.mark.parametrize("n_experts, top_k", SHAPES)
def test_round_robin_expert_is_a_permutation_alike_for_ints_and_tensors(n_experts, top_k):
    slots = torch.arange(n_experts)
    experts = round_robin_expert(slots, n_experts, top_k)
    assert sorted(experts.tolist()) == list(range(n_experts))
    assert experts.tolist() == [round_robin_expert(s, n_experts, top_k) for s in range(n_experts)]


@pytest.mark.parametrize("n_experts, top_k", SHAPES)
@pytest.mark.parametrize("n_tokens", [64, 35, 3])
def test_forced_router_gives_torchtitans_round_robin_counts(n_experts, top_k, n_tokens):
    """Reference: torchtitan's _debug_force_load_balance_routing, arange(T*K) % E; the counts
    are the same multiset (the slot -> expert map is a permutation), max/mean 1.0 when E
    divides T*K, and a token's K experts are distinct."""
    router = forced_router(n_experts, top_k)
    _, _, experts_TK = router(torch.randn(n_tokens, 16), None)
    counts_E = torch.bincount(experts_TK.flatten(), minlength=n_experts)
    ref_E = torch.bincount(torch.arange(n_tokens * top_k) % n_experts, minlength=n_experts)
    assert sorted(counts_E.tolist()) == sorted(ref_E.tolist())
    if n_tokens * top_k % n_experts == 0:
        assert (counts_E.max() / counts_E.float().mean()).item() == 1.0
    assert all(len(set(row)) == top_k for row in experts_TK.tolist())


@pytest.mark.parametrize("n_ranks", [2, 4, 8, 16])
def test_forced_tokens_spread_over_min_ranks_k_ep_ranks(n_ranks: int) -> None:
    router = forced_router(128, 8)
    _, _, experts_TK = router(torch.randn(300, 16), None)
    ranks = [len({e // (128 // n_ranks) for e in row}) for row in experts_TK.tolist()]
    assert set(ranks) == {min(n_ranks, 8)}


@pytest.mark.parametrize("n_experts, top_k", SHAPES)
@pytest.mark.parametrize("n_ranks", [1, 2])
def test_estimator_reach_counts_the_router(n_experts, top_k, n_ranks):
    """round_robin_reach (the estimator's token-dispatch splits) against the router's own
    choices."""
    if n_experts % n_ranks:
        return
    for n_tokens in (1, 37, 200):
        _, _, experts_TK = forced_router(n_experts, top_k)(torch.randn(n_tokens, 16), None)
        per_rank = n_experts // n_ranks
        tokens_W = [sum(any(e // per_rank == w for e in row) for row in experts_TK.tolist())
                    for w in range(n_ranks)]  # fmt: skip
        pairs_E = torch.bincount(experts_TK.flatten(), minlength=n_experts).tolist()
        assert round_robin_reach(n_tokens, top_k, n_experts, n_ranks) == (tokens_W, pairs_E)


def test_forced_moe_forward_is_the_moe_forward_with_round_robin_experts() -> None:
    """Per-token reference in float64: the forced experts, weighted by their renormalised
    softmax probabilities, as the unforced layer weighs its top-k; the router still learns."""
    torch.manual_seed(0)
    moe = MoE(16, 32, 8, 2, force_load_balance=True).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x_BSD = torch.randn(2, 5, 16, dtype=torch.float64)
    out_BSD = moe(x_BSD)
    x_TD, ex = x_BSD.reshape(-1, 16), moe.experts
    ref_TD = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        probs_E = F.softmax(moe.router.gate.weight @ x_TD[t], dim=-1)
        chosen = [round_robin_expert((t * 2 + k) % 8, 8, 2) for k in range(2)]
        w_K = probs_E[chosen] / probs_E[chosen].sum()
        for w, e in zip(w_K, chosen):
            h_I = F.silu(ex.w1[e] @ x_TD[t]) * (ex.w3[e] @ x_TD[t])
            ref_TD[t] += w * (ex.w2[e] @ h_I)
    # The router's softmax runs in float32 whatever the layer's dtype.
    torch.testing.assert_close(out_BSD, ref_TD.view_as(out_BSD), atol=1e-6, rtol=1e-5)
    counts_E = moe.tokens_per_expert
    assert counts_E.sum() == 10 * 2 and counts_E.max() - counts_E.min() == 1  # 20 rows, 8 experts
    out_BSD.square().sum().backward()
    assert moe.router.gate.weight.grad.abs().sum() > 0


def test_forced_router_compiles_in_one_graph_for_any_token_count() -> None:
    """fullgraph: no graph break, so no host read of a count; dynamic token counts."""
    router = forced_router(8, 2)
    compiled = torch.compile(router, backend="eager", fullgraph=True, dynamic=True)
    for n_tokens in (12, 37):
        x_TD = torch.randn(n_tokens, 16)
        for got, want in zip(compiled(x_TD, None), router(x_TD, None)):
            torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_bias_update_is_torchtitans_centred_rule_and_selects_as_uncentred() -> None:
    """torchtitan 0.2.2 (components/optimizer.py): delta = rate * sign(mean - load), minus its
    mean. Selection depends on bias differences only, so the uncentred rule selects alike."""
    torch.manual_seed(0)
    moe = MoE(16, 8, 8, 2, use_expert_bias=True)
    moe.init_weights(0.02)
    x_TD, rate = torch.randn(40, 16), 1e-2
    ref_E, uncentred_E = torch.zeros(8), torch.zeros(8)
    for _ in range(5):
        moe.reset_expert_load()
        _, _, experts_TK = moe.router(x_TD, moe.expert_bias)
        moe(x_TD.view(1, 40, 16))
        _, _, uncentred_TK = moe.router(x_TD, uncentred_E)
        assert torch.equal(experts_TK, uncentred_TK)
        load_E = moe.tokens_per_expert.clone()
        delta_E = rate * torch.sign(load_E.mean() - load_E)
        ref_E += delta_E - delta_E.mean()
        uncentred_E += delta_E
        moe.update_expert_bias(rate)
        torch.testing.assert_close(moe.expert_bias, ref_E, atol=1e-7, rtol=0)
    assert abs(moe.expert_bias.sum().item()) < 1e-6


def _build(layers: int, **overrides) -> Qwen3Model:
    args = dataclasses.replace(qwen3_flavors["30B-A3B"], n_layers=layers, **overrides)
    with torch.device("meta"):
        model = Qwen3Model(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def test_init_embedding_and_router_stds() -> None:
    """torchtitan's: untied embedding N(0, 1), tied N(0, 0.02); router depth-scaled."""
    small = dict(dim=64, n_heads=2, n_kv_heads=1, head_dim=32, moe_hidden_dim=8, vocab_size=512)
    untied = _build(3, **small, num_experts=16, top_k=2)
    assert abs(untied.tok_embeddings.weight.std().item() - 1.0) < 0.02
    tied = _build(1, **small, num_experts=16, top_k=2, tie_embeddings=True)
    assert abs(tied.tok_embeddings.weight.std().item() - 0.02) < 1e-3
    for layer_id, block in untied.layers.items():
        std = 0.02 / (2 * (int(layer_id) + 1)) ** 0.5 * 0.986  # 3-sigma truncation
        assert abs(block.moe.router.gate.weight.std().item() - std) / std < 0.05


def test_first_router_inputs_are_token_specific() -> None:
    """At 30B-A3B's attention width the first attention output (a context average, nearly
    alike for every token) outweighs a 0.02 embedding: the first router's inputs align (mean
    pairwise cosine 0.27 here on uniform random ids, 0.49 on the peer corpus); with the N(0, 1)
    embedding they stay token-specific."""
    torch.manual_seed(0)
    model = _build(1, dim=2048, num_experts=16, moe_hidden_dim=8, vocab_size=1024)
    tokens_BS = torch.randint(0, 1024, (1, 512))

    def router_input_cosine() -> float:
        seen = {}
        hook = model.layers["0"].moe.register_forward_pre_hook(lambda _m, a: seen.update(x=a[0]))
        with torch.no_grad():
            model.forward_hidden(tokens_BS)
        hook.remove()
        unit_TD = F.normalize(seen["x"].flatten(0, 1).double(), dim=-1)
        return unit_TD.mean(0).square().sum().item()

    assert router_input_cosine() < 0.05
    with torch.no_grad():
        model.tok_embeddings.weight.normal_(0, 0.02)
    assert router_input_cosine() > 0.2


class _SentReader(CountReader):
    def ep_token_splits(self, rows_W, recv_WC, n_tokens, top_k):
        splits = super().ep_token_splits(rows_W, recv_WC, n_tokens, top_k)
        self.sent = splits[0]
        return splits


def _forced_ep_rank(tokens: bool) -> dict:
    """This rank's slice through the EP layer against the plain forced layer on that slice
    (the round-robin restarts at each forward, so the slice is the reference's input)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    pd = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, ep=world, world_size=world)
    pd.build_meshes("cpu")
    torch.manual_seed(0)
    moe = MoE(16, 8, 8, 2, force_load_balance=True).double()
    moe.init_weights(0.02)
    x_bSD = torch.randn(2 * world, 7, 16, dtype=torch.float64)[2 * rank : 2 * rank + 2]
    ref = copy.deepcopy(moe)
    ref_out = ref(x_bSD)
    holder = nn.Module()
    holder.layers = nn.ModuleDict({"0": nn.Module()})
    holder.layers["0"].moe = moe
    apply_ep(holder, pd.mesh("ep"), TokenDispatch if tokens else RowDispatch)
    reader = _SentReader()
    with read_counts_with(reader):
        out = moe(x_bSD)
    return {
        "diff": (out - ref_out).abs().max().item(),
        "counts": moe.tokens_per_expert.tolist(),
        "sent": getattr(reader, "sent", None),
    }


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [False, True], ids=["rows", "tokens"])
def test_forced_balance_under_expert_parallel(tokens: bool) -> None:
    results = run_distributed(_forced_ep_rank, 2, tokens)
    n_tokens = 2 * 7  # per rank: 28 rows over 8 experts, 3 or 4 each
    for r in results:
        assert r["diff"] < 1e-12
        assert sum(r["counts"]) == n_tokens * 2 and max(r["counts"]) - min(r["counts"]) == 1
        if tokens:  # what the estimator's RoundRobinCounts predicts
            assert r["sent"] == round_robin_reach(n_tokens, 2, 8, 2)[0]


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["rows", "tokens"])
def test_estimate_of_a_forced_run_matches_real_cpu_ranks(dispatch: str) -> None:
    """The estimator routes as the run does (RoundRobinCounts): the real ranks take its host
    splits, so a wrong split would fail their all-to-all, and the peaks agree."""
    config = load_config([
        "--job.config_file", "train_configs/qwen3_moe_debug.toml", "--training.seq_len", "64",
        "--training.local_batch_size", "2", "--memory_estimation.world_size", "2",
        "--parallelism.expert_parallel_degree", "2",
        "--parallelism.expert_parallel_dispatch", dispatch,
        "--debug.moe_force_load_balance", "true", "--model.moe_aux_loss_coef", "0",
    ])  # fmt: skip
    est = estimate(config, target="cpu")
    assert "round-robin" in est["ranks"][0]["assumption"]
    assert_estimate_matches_ranks(config, est["peak_bytes"], every=0.05)
