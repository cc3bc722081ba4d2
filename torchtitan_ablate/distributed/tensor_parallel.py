"""Tensor parallel (TP) with sequence parallel for Qwen3 (dense and MoE), over the `tp` mesh.

Layout per block (torchtitan's plan, Megatron-LM's scheme):
- The residual stream between blocks is sequence-sharded: each tp rank holds [B, S / tp, D],
  kept as a DTensor (Shard(1)) from the embedding to the final norm. Plain tensors there broke
  the compiled blocks' backward (torch 2.13: the embedding's asynchronous reduce-scatter output,
  handed to a compiled block as a plain tensor, came back with a plain gradient its DTensor
  backward could not take).
- attention_norm / ffn_norm (and the final norm) run on the sequence shard (SequenceParallel:
  replicated weights). Each rank's gradient of such a weight covers only its own tokens (or
  heads), which DTensor leaves as a pending sum (Partial); FSDP, always applied with TP,
  sums it over tp before the optimizer and gradient clipping see it.
- Attention: the normed input is all-gathered over the sequence, wq / wk / wv are split by
  output columns (each rank computes H / tp query and J / tp kv heads), wo by input rows; its
  partial sums are reduce-scattered back to the sequence shard. The attention core runs on the
  rank's whole heads as plain tensors, so every backend (sdpa, flex, varlen, flash) works
  unchanged, and so does context parallel's attention: its rank's heads over the cp rank's
  whole sequence, K/V all-gathered over cp (its masks do not depend on the head count).
  q_norm / k_norm normalise over head_dim within each head; they run as DTensors sharded on the
  heads dim (SequenceParallel on dim 2), so their replicated weights receive the sum of every
  rank's heads' gradients.
- Dense MLP: gate / up split by columns, down by rows (same gather / reduce-scatter).
- MoE layer (MoE blocks, in place of the dense MLP): not split. It takes the rank's sequence
  shard as its own tokens, [B * S / tp, D], and returns its output as that shard again: under
  sequence parallel the tp ranks hold different tokens, so for routing and the experts they
  are more data-parallel ranks, and no activation crosses tp ranks in the MoE layer (the
  alternative, torchtitan's: all-gather the sequence in, every tp rank routes all tokens and
  the experts' sum comes back as a partial sum to reduce-scatter, moves 2 activations more per
  layer and makes EP borrow tp ranks). So: the router's gate weight is a replicated DTensor
  that the router reads as its local copy with a partial gradient (`local_replica`), which
  FSDP sums over tp like the norms'; the routed experts stay out of TP (plain, or EP's
  DTensors over the ep ranks of the rank's own tp coordinate), and FSDP shards them over
  efsdp = dp_shard * cp * tp / ep (ParallelDims' experts mesh), summing their gradients over
  the tp ranks too. The aux loss, the expert load and the bias update are per-rank sums over
  the rank's tokens that the trainer reduces over the loss group, tp included.
- Embedding: split by vocabulary rows; each rank looks up the ids it holds and the partial rows
  are reduce-scattered to the sequence shard.
- Output head: sequence-parallel loss, not vocabulary-parallel ("loss parallel"). The head's
  weight is split by vocabulary rows like the embedding (and is the embedding's when tied); at
  the head it is all-gathered (its gradient reduce-scattered) and each rank computes the logits
  and loss of its own S / tp tokens with whichever loss head the run uses (plain, chunked,
  Liger, cut cross-entropy), which all take the hidden states and the whole weight. Logits per
  rank are [B, S / tp, V], the same size as loss parallel's [B, S, V / tp]; the cost is the
  transient whole [V, D] weight. So labels are sequence-sharded too (`tp_shard_labels`), the
  loss sum is per rank, and the trainer sums it over the tp ranks with the dp / cp ones
  (ParallelDims.loss_group).

- Pipeline stages (a part without the embedding or without the final norm and head): the
  hidden states cross a stage boundary as this rank's plain [B, S / tp, D] slice, made a
  Shard(1) DTensor again on entry (`_shard_stage_boundaries`).

- float8 (tensorwise): the block's float8 linears take torchao's float8 styles instead
  (`TPStyles`, see float8_tensor_parallel.py); same sharding, but the inputs are cast to float8
  before the sequence all-gather (scales from the amax over the whole DTensor, all ranks).

Shape legend: B batch, S sequence, D model dim, V vocabulary.
"""

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan_ablate.distributed.lora_tensor_parallel import (
    LoRAColwiseParallel,
    LoRARowwiseParallel,
)
from torchtitan_ablate.models.common.lora import LoRALinear


def gather_vocab_shards(weight_VD: torch.Tensor) -> torch.Tensor:
    """The output head's whole weight from its vocabulary shards, as a plain tensor. Each rank's
    gradient of it covers only its own tokens, so it is declared partial: the backward sums the
    ranks' gradients while reduce-scattering them back to the shards."""
    assert isinstance(weight_VD, DTensor), "apply_tp shards the output head's weight"
    whole = weight_VD.redistribute(placements=[Replicate()])
    return whole.to_local(grad_placements=[Partial()])


def local_replica(weight: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor weight as a plain tensor, for a module that computes on the rank's
    own tokens (the MoE router): each rank's gradient covers only those, so it is declared
    partial, and FSDP sums it over the tp ranks before the optimizer sees it."""
    assert isinstance(weight, DTensor), "apply_tp replicates the router's gate weight"
    return weight.to_local(grad_placements=[Partial()])


def tp_shard_labels(labels_BS: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """This tp rank's contiguous S / tp slice of the labels: the tokens its loss covers, the
    same slice sequence parallel leaves it of the hidden states (Shard(1))."""
    seq_len, tp = labels_BS.shape[1], tp_mesh.size()
    # ParallelDims.check_model rejected a training.seq_len that tp does not divide.
    assert seq_len % tp == 0, f"seq_len {seq_len} vs tensor_parallel_degree {tp}"
    chunk = seq_len // tp
    start = tp_mesh.get_local_rank() * chunk
    return labels_BS[:, start : start + chunk]


@dataclass(frozen=True)
class TPStyles:
    """The style classes of one kind of linear: plain (nn.Linear) or float8's."""

    colwise: type[ColwiseParallel] = ColwiseParallel
    rowwise: type[RowwiseParallel] = RowwiseParallel
    prepare_input: type[PrepareModuleInput] = PrepareModuleInput


PLAIN = TPStyles()
_ATTN_IN = ("attention.wq", "attention.wk", "attention.wv")
_FFN_IN = ("feed_forward.w1", "feed_forward.w3")


LORA = TPStyles(colwise=LoRAColwiseParallel, rowwise=LoRARowwiseParallel)


def _block_plan(styles: Mapping[str, TPStyles] | None = None, moe: bool = False) -> dict:
    """The plan of one transformer block, dense or `moe` (see the module docstring). The
    linears named in `styles` (block-relative names) take those styles (float8's, LoRA's), the
    others the plain ones; an input is prepared with a special style only when every linear
    reading it takes that style (a float8 input would reach a plain linear otherwise)."""
    styles = styles or {}

    def col(name: str) -> ColwiseParallel:
        return styles.get(name, PLAIN).colwise()

    def row(name: str) -> RowwiseParallel:
        style = styles.get(name, PLAIN)
        return style.rowwise(output_layouts=Shard(1), use_local_output=False)

    def prepare(readers: tuple[str, ...]) -> type[PrepareModuleInput]:
        kinds = {styles.get(r, PLAIN) for r in readers}
        return (kinds.pop() if len(kinds) == 1 else PLAIN).prepare_input

    plan = {
        "attention_norm": SequenceParallel(),
        # (x, cos, sin, mask): only x is sharded; RoPE tables and mask cover the whole sequence.
        "attention": prepare(_ATTN_IN)(
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
        ),
        "attention.wq": col("attention.wq"),
        "attention.wk": col("attention.wk"),
        "attention.wv": col("attention.wv"),
        # [B, S, heads / tp, K]: the per-head norms see the rank's heads as a Shard(2) DTensor.
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.wo": row("attention.wo"),
        "ffn_norm": SequenceParallel(),
    }
    if moe:
        # The rank's own tokens in, its own tokens out (the residual stream's Shard(1)).
        plan["moe"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Shard(1),),
            use_local_input=True,
            output_layouts=(Shard(1),),
            desired_output_layouts=(Shard(1),),
            use_local_output=False,
        )
        return plan
    return plan | {
        "feed_forward": prepare(_FFN_IN)(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": col("feed_forward.w1"),
        "feed_forward.w3": col("feed_forward.w3"),
        "feed_forward.w2": row("feed_forward.w2"),
    }


# The weights of the model's ends, split by vocabulary rows (see apply_tp).
_END_SHARD_DIMS = {"tok_embeddings": 0, "output": 0}


@functools.cache
def _block_shard_dims() -> dict[str, int]:
    """The block plan's linears and the dim each is split on (0 rows, 1 columns)."""
    dims = {}
    for name, style in _block_plan().items():
        if isinstance(style, ColwiseParallel):
            dims[name] = 0
        elif isinstance(style, RowwiseParallel):
            dims[name] = 1
    return dims


def tp_shard_dim(module_name: str) -> int | None:
    """The dim apply_tp splits the weight of the module named `module_name` (the whole model's
    name, e.g. "layers.3.attention.wo") on: 0 (output rows), 1 (input columns), or None when
    it stays whole (the norms). The memory estimator's model-state floor reads it."""
    if module_name in _END_SHARD_DIMS:
        return _END_SHARD_DIMS[module_name]
    return _block_shard_dims().get(module_name.split(".", 2)[-1])


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    special: TPStyles = PLAIN,
    is_special: type[nn.Module] | None = None,
) -> None:
    """Shards a Qwen3 model (meta device is fine) over `tp_mesh` in place; MoE blocks keep
    their experts whole and their router's gate replicated (see the module docstring).

    special / is_special: the block linears that are instances of `is_special` (float8's
    Float8Linear) take `special`'s styles (float8_tensor_parallel.float8_tp_styles).

    Call before CP, AC, compile and FSDP (parallelize_qwen3's order): FSDP then shards the
    tp-local parameters over the dp ranks (a 2-D layout). The batch's labels must be sliced with
    `tp_shard_labels`; input ids, positions and document ids stay whole on every tp rank (with
    context parallel: the cp rank's whole zigzag slice, which sequence parallel then splits).
    """
    ends = {
        "tok_embeddings": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        # Plain [B, S / tp, D] out: the output head computes this rank's tokens only.
        "norm": SequenceParallel(use_local_output=True),
    }
    # A pipeline stage (pipeline_parallel.split_stages) lacks the modules of other stages.
    present = {name: style for name, style in ends.items() if getattr(model, name) is not None}
    # SequenceParallel re-creates the norms' weights trainable: LoRA's frozen ones stay frozen.
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, tp_mesh, present)
    _shard_stage_boundaries(model, tp_mesh)
    output = model.output
    if output is not None:
        if model.args.tie_embeddings:
            # parallelize_module replaced the embedding's Parameter with a sharded one: re-tie.
            output.weight = model.tok_embeddings.weight
        else:
            # src_data_rank=None: each rank slices its own (meta) copy, no scatter.
            sharded = distribute_tensor(output.weight, tp_mesh, [Shard(0)], src_data_rank=None)
            output.weight = nn.Parameter(sharded)
        output.weight_fn = gather_vocab_shards
    for block in model.layers.values():
        styles = {}
        for name, module in block.named_modules():
            if isinstance(module, LoRALinear):
                styles[name] = LORA
            elif is_special is not None and isinstance(module, is_special):
                styles[name] = special
        parallelize_module(block, tp_mesh, _block_plan(styles, block.moe is not None))
        if block.moe is not None:
            router = block.moe.router
            gate = router.gate.weight
            replicated = distribute_tensor(gate, tp_mesh, [Replicate()], src_data_rank=None)
            router.gate.weight = nn.Parameter(replicated, gate.requires_grad)
            router.gate_weight_fn = local_replica
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)


def _shard_stage_boundaries(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """A pipeline stage's boundaries under sequence parallel. The pipeline sends plain tensors
    of static shapes between stages: this rank's [B, S / tp, D] slice of the residual stream.
    A stage without the embedding takes that slice as its first argument and makes it the
    Shard(1) DTensor its blocks expect (whose global shape gives the model the whole sequence
    length for its attention mask); a stage without the final norm returns its blocks' DTensor
    as the plain slice. A whole model (both ends present) is left alone."""
    if model.tok_embeddings is None:
        parallelize_module(
            model,
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=False
            ),
        )
    if model.norm is None:
        model.register_forward_hook(_local_slice)


def _local_slice(module: nn.Module, args: tuple, h_BSD: DTensor) -> torch.Tensor:
    """This rank's [B, S / tp, D] of the stage's output, as a copy: to_local's view cannot be
    detached in place, which the zero-bubble schedules' input backward does to stage outputs."""
    assert h_BSD.placements == (Shard(1),), h_BSD.placements
    return h_BSD.to_local().clone()
