"""Tensor parallel on an MoE Qwen3, 2 gloo ranks against one process: the loss and every
gradient once summed over the tp ranks (what FSDP does in training: the router's gate
gradient is left pending as a Partial DTensor, the experts' as each rank's own-token part),
and the router and experts are not split. Training through the trainer (FSDP, EP) is compared
in tests/integration/test_parallel_equivalence.py."""

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from tests.helpers.distributed import run_distributed
from tests.helpers.tiny_qwen3 import tp_model
from torchtitan_ablate.components.objective.loss import cross_entropy_sum
from torchtitan_ablate.distributed.tensor_parallel import tp_shard_labels
from torchtitan_ablate.models.qwen3 import qwen3_flavors

# Two MoE layers, no aux loss (each tp rank's covers its own tokens: not the one process's).
ARGS = dataclasses.replace(qwen3_flavors["debugmodel_moe"], n_layers=2, moe_aux_loss_coef=0.0)


def _tp_sum(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t)
    return t


def _summed_grad(p: torch.Tensor) -> torch.Tensor:
    """The parameter's gradient summed over the tp ranks, as a whole tensor."""
    if isinstance(p.grad, DTensor):
        return p.grad.full_tensor()  # Partial placements sum, Shard ones gather
    return _tp_sum(p.grad)  # a plain (expert) parameter: each rank's own tokens' part


def _compare() -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    ref, tp = tp_model(ARGS), tp_model(ARGS, mesh)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 32), generator=g)
    labels = torch.randint(0, ARGS.vocab_size, (2, 32), generator=g)
    ref_loss = cross_entropy_sum(ref(tokens), labels)
    tp_loss = cross_entropy_sum(tp(tokens), tp_shard_labels(labels, mesh))
    ref_loss.backward()
    tp_loss.backward()
    total = _tp_sum(tp_loss)  # each rank's loss covers its S / tp tokens
    # Every rank routes its own tokens: the loads summed over tp are the one process's.
    load_equal = torch.equal(ref.expert_load(), _tp_sum(tp.expert_load()))
    ref_params = dict(ref.named_parameters())
    diffs, kinds = {}, {}
    for name, p in tp.named_parameters():
        r = ref_params[name]
        whole = p.full_tensor() if isinstance(p, DTensor) else p
        grad = (_summed_grad(p) - r.grad).abs().max().item()
        diffs[name] = ((whole - r).abs().max().item(), grad)
        kinds[name] = p.placements if isinstance(p, DTensor) else None
    return {
        "loss": (ref_loss.item(), total.item()),
        "load_equal": load_equal,
        "params": diffs,
        "kinds": kinds,
    }


def test_moe_tp2_loss_and_gradients_match_one_process():
    out = run_distributed(_compare, 2)[0]
    loss_ref, loss_tp = out["loss"]
    assert abs(loss_tp - loss_ref) <= 1e-5 * abs(loss_ref), out["loss"]
    assert out["load_equal"]
    for name, (value, grad) in out["params"].items():
        assert value == 0, (name, value)  # per-name init: the same weights
        assert grad <= 1e-5, (name, grad)
    kinds = out["kinds"]
    assert kinds["layers.0.moe.router.gate.weight"] == (Replicate(),)
    assert kinds["layers.0.moe.experts.w1"] is None  # whole on every tp rank
    assert kinds["layers.0.attention.wq.weight"] is not None  # attention split as dense
