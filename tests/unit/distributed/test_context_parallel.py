"""Context parallel vs the single-process run on 2 gloo ranks: attention and the whole model.

Every rank builds the same seeded inputs (and model), computes the single-process reference, then
runs its zigzag slice through the CP path. Each rank's loss covers only its own tokens, so outputs
compare slice by slice and gradients compare after summing over ranks (what FSDP does over cp).
The same checks run on 2 GPUs (NCCL, FlexAttention, compiled blocks) where they exist.
"""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import run_distributed
from torchtitan_ablate.components.compile import apply_compile
from torchtitan_ablate.components.objective.loss import (
    IGNORE_INDEX,
    cross_entropy_sum,
    num_valid_tokens,
)
from torchtitan_ablate.distributed.context_parallel import (
    apply_cp,
    build_cp_mask,
    cp_attention,
    cp_shard_batch,
    cp_unshard,
    zigzag_index,
)
from torchtitan_ablate.distributed.parallel_dims import ParallelDims
from torchtitan_ablate.models.common.attention import attention, build_attention_mask
from torchtitan_ablate.models.qwen3.args import qwen3_flavors
from torchtitan_ablate.models.qwen3.model import Qwen3Model

pytestmark = pytest.mark.slow  # multi-process

CP = 2
B, S, H, J, K = 2, 16, 4, 2, 8
TOL = {"atol": 1e-5, "rtol": 1e-5}
# CUDA: FlexAttention (head_dim >= 16) against the SDPA reference; kernels round differently.
GPU_S, GPU_K, GPU_TOL = 512, 16, {"atol": 2e-4, "rtol": 2e-4}


def _cp_mesh(device: str):
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank())
    pd = ParallelDims(dp_replicate=1, dp_shard=1, cp=CP, ep=1, world_size=CP)
    pd.build_meshes(device)
    return pd.mesh("cp")


def _packed_document_ids(seq_len: int) -> torch.Tensor:
    # Row 0: three documents, the middle one crossing chunk boundaries; row 1: a single document.
    a, b = 5 * seq_len // 16, 12 * seq_len // 16
    row0 = torch.tensor([0] * a + [1] * (b - a) + [2] * (seq_len - b))
    return torch.stack([row0, torch.zeros(seq_len, dtype=torch.long)])


def _segment_positions(document_ids_BS: torch.Tensor) -> torch.Tensor:
    # Positions restart at 0 in every document, as the packing loader supplies them.
    index_S = torch.arange(document_ids_BS.shape[1])
    first_BS = (document_ids_BS.unsqueeze(2) == document_ids_BS.unsqueeze(1)).int().argmax(2)
    return index_S - first_BS


def _attention_parity(
    device: str = "cpu", seq_len: int = S, head_dim: int = K, tol: dict = TOL
) -> None:
    mesh = _cp_mesh(device)
    index_L = zigzag_index(seq_len, mesh.get_local_rank(), CP, device)
    for document_ids_BS in (None, _packed_document_ids(seq_len).to(device)):
        torch.manual_seed(0)
        q_BSHK, k_BSJK, v_BSJK = (
            torch.randn(B, seq_len, n, head_dim, device=device, requires_grad=True)
            for n in (H, J, J)
        )
        grad_BSHK = torch.randn(B, seq_len, H, head_dim, device=device)
        ref_mask = build_attention_mask("sdpa", document_ids_BS, B, seq_len, torch.device(device))
        ref_BSHK = attention(q_BSHK, k_BSJK, v_BSJK, ref_mask)
        ref_BSHK.backward(grad_BSHK)

        local = [t.detach()[:, index_L].requires_grad_() for t in (q_BSHK, k_BSJK, v_BSJK)]
        doc_BL = None if document_ids_BS is None else document_ids_BS[:, index_L]
        mask = build_cp_mask(doc_BL, seq_len // CP, mesh, device)
        assert (mask.block_mask is not None) == (device == "cuda")
        out_BLHK = cp_attention(*local, mask)
        out_BLHK.backward(grad_BSHK[:, index_L])

        torch.testing.assert_close(out_BLHK, ref_BSHK.detach()[:, index_L], **tol)
        for shard, full in zip(local, (q_BSHK, k_BSJK, v_BSJK)):
            torch.testing.assert_close(cp_unshard(shard.grad, mesh), full.grad, **tol)


def test_attention_matches_single_process() -> None:
    run_distributed(_attention_parity, CP)


def _tiny_model(device: str, seq_len: int, cp_mesh=None) -> Qwen3Model:
    args = replace(
        qwen3_flavors["debugmodel"],
        vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
        max_seq_len=seq_len,
    )  # fmt: skip
    with torch.device("meta"):
        model = Qwen3Model(args)
    if cp_mesh is not None:
        apply_cp(model, cp_mesh)
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights()
    return model


def _model_parity(
    device: str = "cpu", seq_len: int = S, tol: dict = TOL, compile: bool = False
) -> tuple[float, float]:
    mesh = _cp_mesh(device)
    torch.manual_seed(1)
    document_ids_BS = _packed_document_ids(seq_len)
    labels_BS = torch.randint(0, 128, (B, seq_len))
    labels_BS[1, -3:] = IGNORE_INDEX
    batch = {
        "input_ids": torch.randint(0, 128, (B, seq_len)),
        "labels": labels_BS,
        "positions": _segment_positions(document_ids_BS),
        "document_ids": document_ids_BS,
    }
    batch = {key: value.to(device) for key, value in batch.items()}
    global_tokens = num_valid_tokens(batch["labels"])

    ref_model, cp_model = _tiny_model(device, seq_len), _tiny_model(device, seq_len, mesh)
    if compile:
        apply_compile(cp_model, fullgraph=True)
    logits = ref_model(batch["input_ids"], batch["positions"], batch["document_ids"])
    ref_loss = cross_entropy_sum(logits, batch["labels"]) / global_tokens
    ref_loss.backward()

    local = cp_shard_batch(batch, mesh)
    logits = cp_model(local["input_ids"], local["positions"], local["document_ids"])
    loss = cross_entropy_sum(logits, local["labels"]) / global_tokens
    loss.backward()

    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref_loss.detach(), **tol)
    ref_params = dict(ref_model.named_parameters())
    for name, param in cp_model.named_parameters():
        dist.all_reduce(param.grad)
        name = name.replace("._orig_mod", "")  # compiled blocks
        torch.testing.assert_close(param.grad, ref_params[name].grad, **tol, msg=name)
    return total.item(), ref_loss.item()


def test_model_matches_single_process() -> None:
    # Each rank also compared every gradient with the reference model's (inside the worker).
    for cp_loss, ref_loss in run_distributed(_model_parity, CP):
        assert cp_loss == pytest.approx(ref_loss, rel=1e-5), (cp_loss, ref_loss)


def _shard_round_trip() -> None:
    mesh = _cp_mesh("cpu")
    input_ids_BS = torch.arange(B * S).view(B, S)
    local = cp_shard_batch({"input_ids": input_ids_BS, "labels": input_ids_BS + 1}, mesh)
    expected_L = zigzag_index(S, mesh.get_local_rank(), CP)
    assert torch.equal(local["positions"][0], expected_L)  # global positions when absent
    assert local["input_ids"].shape == (B, S // CP)
    for key, full_BS in (("input_ids", input_ids_BS), ("labels", input_ids_BS + 1)):
        assert torch.equal(cp_unshard(local[key], mesh), full_BS), key


def test_shard_round_trip() -> None:
    run_distributed(_shard_round_trip, CP)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < CP, reason=f"needs {CP} CUDA devices")
def test_flex_attention_and_compiled_model_on_cuda() -> None:
    run_distributed(_attention_parity, CP, "cuda", GPU_S, GPU_K, GPU_TOL, backend="nccl")
    run_distributed(_model_parity, CP, "cuda", GPU_S, GPU_TOL, True, backend="nccl")
