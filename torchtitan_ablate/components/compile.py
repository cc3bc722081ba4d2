"""torch.compile per transformer block: small graphs compile fast and are reused by every
block of the same shape; FSDP's hooks (applied later) stay outside the graphs.

A block that graph-breaks (MoE: host reads of token counts, expert parallel's all-to-all split
sizes) is compiled inside its checkpoint wrapper, not around it. Dynamo traces a checkpointed
body as one higher-order op that cannot break, so a break there sends the whole block to eager:
under full AC the 48-layer Qwen3-30B-A3B ran its router, permutations and expert SwiGLU as
single aten kernels (docs/performance.md). Inside the wrapper, Dynamo compiles the block's
frames around the breaks and the checkpoint recomputes the compiled forward in backward. A
per-op policy (selective "op") needs the higher-order op to see the ops, so those blocks keep
the wrapper inside the compiled region.

The backend is a seam: the trainer compiles with Inductor; the memory estimator passes its own
backend (estimator/compiled.py), which partitions the same graphs as Inductor and runs them on
fake tensors, through the build path's `BuildOptions.compile_backend`."""

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

CompileBackend = str | Callable
INDUCTOR = "inductor"


def apply_compile(
    model: nn.Module, fullgraph: bool, backend: CompileBackend = INDUCTOR, op_policy: bool = False
) -> None:
    """Compiles each block of model.layers in place. MoE blocks pass fullgraph=False (their
    host reads of token counts break the graph); those of them that a whole-block checkpoint
    wraps (op_policy False) are compiled inside the wrapper."""
    for name, block in list(model.layers.items()):
        if not fullgraph and not op_policy and isinstance(block, CheckpointWrapper):
            # In place (nn.Module.compile): no `_orig_mod` inside the wrapper, whose name DCP
            # would keep (it strips the wrapper's prefix first) and checkpoints would change.
            block._checkpoint_wrapped_module.compile(backend=backend)
            continue
        model.layers.register_module(
            name, torch.compile(block, fullgraph=fullgraph, backend=backend)
        )
