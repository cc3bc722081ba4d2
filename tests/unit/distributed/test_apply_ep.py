"""apply_ep on the meta-device Qwen3 MoE: sharded experts under their own names and class, the
same initial weights as without EP, a training step; the received rows' expert-order rank."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from tests.helpers.distributed import run_distributed
from torchtitan_ablate.distributed.ep_token_dispatch import TokenDispatch
from torchtitan_ablate.distributed.expert_parallel import apply_ep, rank_in_expert_order
from torchtitan_ablate.distributed.parallel_dims import ParallelDims
from torchtitan_ablate.models.common.experts import GroupedExperts
from torchtitan_ablate.models.common.lora import apply_lora
from torchtitan_ablate.models.qwen3.args import qwen3_flavors
from torchtitan_ablate.models.qwen3.model import Qwen3Model

WEIGHTS = ("w1", "w2", "w3")


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


@pytest.mark.slow
def test_apply_ep_on_meta_qwen3_moe() -> None:
    for is_dtensor, shapes, has_grad, init_diff in run_distributed(_meta_model_rank, 2):
        assert is_dtensor and has_grad
        assert shapes[0][0] == 8 and shapes[1][0] == 4 and shapes[0][1:] == shapes[1][1:]
        assert init_diff == 0  # the same initial experts as without EP


def _lora_tokens_rank() -> tuple:
    pd = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, ep=2, world_size=2)
    pd.build_meshes("cpu")
    with torch.device("meta"):
        model = Qwen3Model(qwen3_flavors["debugmodel_moe"])
    apply_lora(model, 4, 8.0, 0.0, ["q_proj", "experts"])
    names = [n for n, _ in model.named_parameters()]
    apply_ep(model, pd.mesh("ep"), TokenDispatch)
    experts = [moe.experts for moe in model.moe_layers()]
    placements = {(n, p.placements) for e in experts for n, p in e.named_parameters(recurse=False)}
    try:
        apply_ep(model, pd.mesh("ep"))
        twice = None
    except ValueError as e:
        twice = str(e)
    kinds = {(type(e), type(e.dispatch)) for e in experts}
    return names == [n for n, _ in model.named_parameters()], placements, kinds, twice


@pytest.mark.slow
def test_lora_and_token_dispatch_keep_names_class_and_shard_adapters() -> None:
    for same_names, placements, kinds, twice in run_distributed(_lora_tokens_rank, 2):
        assert same_names  # DCP, the HF adapter and FSDP see the same FQNs
        assert kinds == {(GroupedExperts, TokenDispatch)}  # composed, no class swap
        lora = {f"lora_{ab}_{w}" for ab in "ab" for w in WEIGHTS}
        assert placements == {(n, (Shard(0),)) for n in [*WEIGHTS, *lora]}
        assert twice is not None and "already has expert parallel applied" in twice


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
        assert torch.equal(rank_in_expert_order(recv_WL, n), expected)
