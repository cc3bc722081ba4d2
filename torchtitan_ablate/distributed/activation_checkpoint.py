"""Activation checkpointing per transformer block: full, every n-th block, or per-op policy."""

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper as ptd_checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# "op" policy: keep the outputs of the expensive ops (matmuls, attention), recompute the
# cheap elementwise ones (norms, activations, RoPE) in backward.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
if hasattr(torch.ops.aten, "_grouped_mm"):
    _SAVE_OPS.add(torch.ops.aten._grouped_mm.default)


def _op_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_context():
    return create_selective_checkpoint_contexts(_op_policy)


def apply_ac(model: nn.Module, mode: str, selective_ac_option: str) -> None:
    """Wraps blocks of model.layers in place (non-reentrant checkpointing)."""
    for i, (name, block) in enumerate(list(model.layers.items())):
        if mode == "full":
            wrapped = ptd_checkpoint_wrapper(block, preserve_rng_state=False)
        elif selective_ac_option == "op":
            wrapped = ptd_checkpoint_wrapper(
                block, context_fn=_op_context, preserve_rng_state=False
            )
        elif i % int(selective_ac_option) == 0:
            wrapped = ptd_checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            continue
        model.layers.register_module(name, wrapped)
