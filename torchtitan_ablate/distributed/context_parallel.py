"""Context parallel (CP): shard the sequence over the `cp` mesh; attention sees every key.

Layout: head-tail (zigzag) load balancing. The global sequence is cut into 2 * cp chunks and cp
rank r keeps chunks r and 2 * cp - 1 - r, so every rank holds one cheap (early) and one expensive
(late) chunk of the causal triangle and all ranks do the same attention work. `cp_shard_batch`
slices the batch this way; positions and document ids stay the loader's global values, so RoPE
needs nothing special.

Attention: all-gather of K and V over the cp mesh (not a ring). With GQA, K and V are
n_kv_heads / n_heads the size of Q (1/2 to 1/16 for Qwen3), so holding the full K/V costs little
memory, and one collective per layer is simpler than a ring of cp - 1 exchanges with log-sum-exp
merging. The gather is autograd-aware (its backward is a reduce-scatter), so gradients are exact on
every device; one code path serves CPU gloo (tests, estimator) and CUDA NCCL. The gathered keys are
put back in global order and each rank attends its local queries to all of them under
"key index <= query index, same document". Kernel by device: CUDA runs compiled FlexAttention
with a BlockMask (no dense mask, forward and backward); CPU runs SDPA with a dense bool mask
(FlexAttention backward is refused on CPU).

`apply_cp` sets the model's two attention hooks: `build_mask` (the CP mask, once per forward)
and every layer's `attention_fn` (`cp_attention`).

With tensor parallel (applied first): the batch is zigzag-sliced over cp first and sequence
parallel splits each cp rank's L tokens over tp (labels too: `place_micro_batch`); attention's
input is all-gathered over tp to the cp rank's L tokens before the projections, so
`cp_attention` sees plain [B, L, H / tp, K] queries and J / tp kv heads and gathers K/V over
its cp group (the ranks of the same tp index). The masks broadcast over heads (no head dim),
so the CUDA BlockMask is the same with or without TP.

Shape legend: B batch, S global sequence, L local sequence (S / cp), C chunk (S / (2 * cp)),
D model dim, H query heads, J kv heads, K head_dim.
"""

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from torchtitan_ablate.distributed.parallel_dims import ParallelDims
from torchtitan_ablate.distributed.tensor_parallel import tp_shard_labels
from torchtitan_ablate.models.common.attention import dense_kernel

# Batch entries laid out [B, S] along the sequence; anything else passes through unsharded.
CP_SHARDED_KEYS = ("input_ids", "labels", "positions", "document_ids")

# Autograd-aware all-gather (backward: reduce-scatter). Newer torch renamed it and deprecates the
# old name with a warning per call site; older torch (2.11) may have only the old name.
_all_gather = (
    getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
)


# ---- layout ------------------------------------------------------------------------------------


def zigzag_index(
    seq_len: int, cp_rank: int, cp_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global sequence indices [L] of the tokens cp rank `cp_rank` holds."""
    chunk = seq_len // (2 * cp_size)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail_start = (2 * cp_size - 1 - cp_rank) * chunk
    tail = torch.arange(tail_start, tail_start + chunk, device=device)
    return torch.cat([head, tail])


def cp_shard_batch(batch: dict[str, torch.Tensor], cp_mesh: DeviceMesh) -> dict:
    """This cp rank's zigzag slice (dim 1) of input_ids, labels, positions and document_ids.

    Positions are the loader's global values; a batch without them gets arange(S), which is
    what the model would have used on the whole sequence.
    """
    cp_size, cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()
    batch_size, seq_len = batch["input_ids"].shape[:2]
    # ParallelDims.check_model rejected a training.seq_len that 2 * cp does not divide.
    assert seq_len % (2 * cp_size) == 0, f"seq_len {seq_len} vs 2 * cp = {2 * cp_size}"
    out = dict(batch)
    if out.get("positions") is None:
        device = batch["input_ids"].device
        out["positions"] = torch.arange(seq_len, device=device).expand(batch_size, seq_len)
    index_L = zigzag_index(seq_len, cp_rank, cp_size, batch["input_ids"].device)
    for key in CP_SHARDED_KEYS:
        if out.get(key) is not None:
            out[key] = out[key].index_select(1, index_L)
    return out


def place_micro_batch(batch: dict, parallel_dims: ParallelDims, device: torch.device) -> dict:
    """A loader micro-batch as the model takes it: this cp rank's slice and, under tensor
    parallel, this tp rank's slice of the labels (the tokens its loss covers), on the device."""
    if parallel_dims.cp_enabled:
        batch = cp_shard_batch(batch, parallel_dims.mesh("cp"))
    if parallel_dims.tp_enabled:
        batch = {**batch, "labels": tp_shard_labels(batch["labels"], parallel_dims.mesh("tp"))}
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def cp_unshard(x_BL: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """Inverse of the zigzag slice: [B, L, ...] on every cp rank -> [B, S, ...] in global order.
    Autograd-aware: the backward sums all ranks' gradients of this rank's tokens."""
    return _gather_global_order(x_BL, cp_mesh.get_group())


def _gather_global_order(
    x: torch.Tensor, group: dist.ProcessGroup, seq_dim: int = 1
) -> torch.Tensor:
    """All-gathers the zigzag shards x (sequence along seq_dim, batch along dim 0) and returns
    the whole sequence in global order; the result is contiguous (one copy after the gather)."""
    cp_size, local_len = group.size(), x.shape[seq_dim]
    gathered = _all_gather(x.contiguous(), 0, group)  # [cp * B, ...], ranks in order
    # Wait now: until its first non-view op the result is an AsyncCollectiveTensor, whose view ops
    # each go through Python dispatch (the reorder below took 0.58 ms instead of 0.23 on H200).
    gathered = funcol.wait_tensor(gathered)
    # Rank r holds chunk r in slot 0 and chunk 2 * cp - 1 - r in slot 1 of its sequence.
    g = gathered.unflatten(0, (cp_size, x.shape[0])).unflatten(seq_dim + 1, (2, local_len // 2))
    heads = [g[r].select(seq_dim, 0) for r in range(cp_size)]
    tails = [g[r].select(seq_dim, 1) for r in reversed(range(cp_size))]
    return torch.cat(heads + tails, dim=seq_dim)


# ---- attention ---------------------------------------------------------------------------------


@dataclass
class CPMask:
    """What one forward's CP attention needs besides q/k/v; built once, used by every layer."""

    group: dist.ProcessGroup
    dense_B1LS: torch.Tensor | None = None  # CPU: key index <= query index AND same document
    block_mask: BlockMask | None = None  # CUDA: the same rule for FlexAttention


def build_cp_mask(
    document_ids_BL: torch.Tensor | None,
    local_len: int,
    cp_mesh: DeviceMesh,
    device: torch.device | str,
) -> CPMask:
    """Gathers the document ids of all keys (one small collective per forward, not per layer)
    and builds the mask of this rank's queries against the whole sequence."""
    group, cp_rank, cp_size = cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size()
    seq_len = local_len * cp_size
    q_index_L = zigzag_index(seq_len, cp_rank, cp_size, device)
    doc_k_BS = None
    if document_ids_BL is not None:
        doc_k_BS = _gather_global_order(document_ids_BL, group)
    if torch.device(device).type == "cuda":
        if doc_k_BS is None:
            block_mask = _causal_block_mask(local_len, cp_rank, cp_size, str(device))
        else:
            block_mask = _document_block_mask(q_index_L, document_ids_BL, doc_k_BS)
        return CPMask(group, block_mask=block_mask)
    causal_LS = torch.arange(seq_len, device=device) <= q_index_L.unsqueeze(1)
    mask_B1LS = causal_LS.expand(1, 1, local_len, seq_len)
    if doc_k_BS is not None:
        same_doc_BLS = document_ids_BL.unsqueeze(2) == doc_k_BS.unsqueeze(1)
        mask_B1LS = (same_doc_BLS & causal_LS).unsqueeze(1)
    return CPMask(group, dense_B1LS=mask_B1LS)


@functools.lru_cache(maxsize=8)
def _causal_block_mask(local_len: int, cp_rank: int, cp_size: int, device: str) -> BlockMask:
    seq_len = local_len * cp_size
    q_index_L = zigzag_index(seq_len, cp_rank, cp_size, device)

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_index_L[q_idx]

    return create_block_mask(causal, None, None, local_len, seq_len, device=device)


def _document_block_mask(q_index_L, doc_q_BL, doc_k_BS) -> BlockMask:
    def causal_same_document(b, h, q_idx, kv_idx):
        same_doc = doc_q_BL[b, q_idx] == doc_k_BS[b, kv_idx]
        return (kv_idx <= q_index_L[q_idx]) & same_doc

    (batch, local_len), seq_len = doc_q_BL.shape, doc_k_BS.shape[1]
    # Built every forward (documents change); compiled it took 3.6 ms instead of 10 at S = 8192.
    return create_block_mask(
        causal_same_document, batch, None, local_len, seq_len, q_index_L.device, _compile=True
    )


@functools.cache
def _compiled_flex():
    # Compiled once per process, lazily; eager flex materialises the full score matrix.
    return torch.compile(flex_attention)


def cp_attention(
    q_BLHK: torch.Tensor, k_BLJK: torch.Tensor, v_BLJK: torch.Tensor, mask: CPMask
) -> torch.Tensor:
    """Local queries against the all-gathered keys/values; returns [B, L, H, K]."""
    # K and V travel in one collective: one launch and one reduce-scatter in backward instead of
    # two (1.4 ms instead of 1.9 for gather + backward at S = 8192 on H200, eager). They are
    # gathered head-major so each head's [S, K] is contiguous: with K/V strided over the heads,
    # flex fwd+bwd took 29.5 ms instead of 18.8 (S = 32768, cp 2, H200).
    kv_B2JLK = torch.cat([k_BLJK, v_BLJK], dim=2).transpose(1, 2)
    k_BJSK, v_BJSK = _gather_global_order(kv_B2JLK, mask.group, seq_dim=2).chunk(2, dim=1)
    q_BHLK = q_BLHK.transpose(1, 2)
    if mask.block_mask is not None:
        out_BHLK = _compiled_flex()(
            q_BHLK, k_BJSK, v_BJSK, block_mask=mask.block_mask, enable_gqa=True
        )
    else:
        out_BHLK = dense_kernel()(
            q_BHLK, k_BJSK, v_BJSK, attn_mask=mask.dense_B1LS, enable_gqa=True
        )
    return out_BHLK.transpose(1, 2)


# ---- model wiring ------------------------------------------------------------------------------


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Makes `model` (meta device is fine) run on zigzag-sharded batches (`cp_shard_batch`).

    Replaces the model's two attention hooks: `build_mask` (once per forward) and each layer's
    `attention_fn`. Positions must come with the batch (the data loader supplies them and
    cp_shard_batch keeps their global values). Call before AC, compile and FSDP.
    """

    def build_mask(backend, document_ids_BL, batch, local_len, device) -> CPMask:
        return build_cp_mask(document_ids_BL, local_len, cp_mesh, device)

    model.build_mask = build_mask
    for block in model.layers.values():
        block.attention.attention_fn = cp_attention
