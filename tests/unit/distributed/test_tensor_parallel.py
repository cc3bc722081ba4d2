"""Tensor parallel on 2 gloo ranks computes what one process computes: the loss and every
gradient of a dense Qwen3 (tied and untied output head, logits and chunked loss head), over two
accumulated micro-batches; plus the model-size rules of ParallelDims and the tp mesh's ranks.
Training through the trainer (FSDP included) is compared in tests/integration/."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.helpers.distributed import run_distributed
from tests.helpers.tiny_qwen3 import tp_model
from torchtitan_ablate.components.objective.loss import chunked_loss_head, cross_entropy_sum
from torchtitan_ablate.distributed.parallel_dims import ParallelDims, ParallelDimsError
from torchtitan_ablate.distributed.tensor_parallel import tp_shard_labels
from torchtitan_ablate.models.qwen3 import qwen3_flavors
from torchtitan_ablate.models.qwen3.parallelize import tp_split_sizes

# debugmodel with 2 layers: 8 query / 4 kv heads, so each of 2 ranks holds a GQA group of 4 / 2.
ARGS = dataclasses.replace(qwen3_flavors["debugmodel"], n_layers=2)


def _loss(model, tokens_BS, labels_BS, chunked: bool) -> torch.Tensor:
    if chunked:
        return model(tokens_BS, labels_BS=labels_BS, loss_head=chunked_loss_head(16))
    return cross_entropy_sum(model(tokens_BS), labels_BS)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(tied: bool, chunked: bool) -> dict:
    """Max differences (loss, per-parameter value and gradient) of TP 2 against one process,
    both run on every rank from the same seed. The norms' gradients are left pending (Partial)
    without FSDP; full_tensor() sums them."""
    args = dataclasses.replace(ARGS, tie_embeddings=tied)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    ref, tp = tp_model(args), tp_model(args, mesh)
    g = torch.Generator().manual_seed(1)
    loss_ref = loss_tp = 0.0
    for _ in range(2):  # two micro-batches: gradients accumulate
        tokens = torch.randint(0, args.vocab_size, (2, 32), generator=g)
        labels = torch.randint(0, args.vocab_size, (2, 32), generator=g)
        ref_loss = _loss(ref, tokens, labels, chunked)
        tp_loss = _loss(tp, tokens, tp_shard_labels(labels, mesh), chunked)
        ref_loss.backward()
        tp_loss.backward()
        loss_ref += ref_loss.item()
        total = tp_loss.detach().clone()
        dist.all_reduce(total)  # each rank's loss covers its S / tp tokens
        loss_tp += total.item()
    ref_params = dict(ref.named_parameters())
    diffs = {}
    for name, p in tp.named_parameters():
        r = ref_params[name]
        value = (_whole(p) - r).abs().max().item()
        grad = (_whole(p.grad) - r.grad).abs().max().item()
        diffs[name] = (value, grad)
    return {
        "loss": (loss_ref, loss_tp),
        "params": diffs,
        "tied": tp.output.weight is tp.tok_embeddings.weight,
    }


def _compare_all() -> list[dict]:
    # Tied with logits, untied with the chunked loss head: each head path and each tying once.
    return [_compare(tied=True, chunked=False), _compare(tied=False, chunked=True)]


def test_tp2_loss_and_gradients_match_one_process():
    for out in run_distributed(_compare_all, 2)[0]:
        loss_ref, loss_tp = out["loss"]
        assert abs(loss_tp - loss_ref) <= 1e-5 * abs(loss_ref), out["loss"]
        assert len(out["params"]) == 2 * 11 + 3 - out["tied"]  # blocks, embedding, norm, head
        for name, (value, grad) in out["params"].items():
            assert value == 0, (name, value)  # per-name init: the same weights
            assert grad <= 1e-5, (name, grad)


def test_tp_must_divide_the_split_sizes():
    pd = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, ep=1, world_size=4, tp=4)
    pd.check_model(0, 64, {"n_heads": 8, "n_kv_heads": 4, "hidden_dim": 768})
    with pytest.raises(ParallelDimsError, match=r"= 4 must divide model n_kv_heads = 2 \("):
        pd.check_model(0, 64, {"n_heads": 8, "n_kv_heads": 2})
    with pytest.raises(ParallelDimsError, match="must divide training.seq_len = 66"):
        pd.check_model(0, 66)
    pd.check_model(8, 64)  # MoE: its experts are not split by TP (tensor_parallel.py)
    # The dense FFN width only where a layer is dense: an all-MoE model never splits it.
    assert "hidden_dim" in tp_split_sizes(ARGS)
    assert "hidden_dim" not in tp_split_sizes(qwen3_flavors["debugmodel_moe"])
    sparse = dataclasses.replace(qwen3_flavors["debugmodel_moe"], decoder_sparse_step=2)
    assert "hidden_dim" in tp_split_sizes(sparse)
    # With CP, sequence parallel splits each cp rank's sequence: 68 is whole 2 * cp chunks, but
    # its cp rank's 34 tokens do not split over tp 4.
    tp_cp = ParallelDims(dp_replicate=1, dp_shard=1, cp=2, ep=1, world_size=8, tp=4)
    tp_cp.check_model(0, 72)
    needle = "= 4 must divide training.seq_len / context_parallel_degree = 68 / 2 = 34"
    with pytest.raises(ParallelDimsError, match=needle):
        tp_cp.check_model(0, 68)
    with pytest.raises(ParallelDimsError, match=r"1 \* 2 \* 1 \* 4 = 8, but the world size is 4"):
        ParallelDims(dp_replicate=1, dp_shard=2, cp=1, ep=1, world_size=4, tp=4)
    assert ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=8, tp=2).dp_shard == 4


def _tp_groups() -> tuple[list[int], list[int], int]:
    pd = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=4, tp=2)
    pd.build_meshes("cpu")
    tp, fsdp = pd.mesh("tp"), pd.mesh("fsdp")
    return tp.mesh.flatten().tolist(), fsdp.mesh.flatten().tolist(), pd.dp_rank()


def test_tp_is_the_innermost_mesh_dimension():
    # tp groups are consecutive ranks; FSDP shards across them; tp peers read the same batch.
    out = run_distributed(_tp_groups, 4)
    assert [o[0] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o[1] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [o[2] for o in out] == [0, 0, 1, 1]
