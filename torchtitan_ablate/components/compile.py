"""torch.compile per transformer block: small graphs compile fast and are reused by every
block of the same shape; FSDP's hooks (applied later) stay outside the graphs.

The backend is a seam: the trainer compiles with Inductor; the memory estimator passes its own
backend (estimator/compiled.py), which partitions the same graphs as Inductor and runs them on
fake tensors, through the build path's `BuildOptions.compile_backend`."""

from collections.abc import Callable

import torch
import torch.nn as nn

CompileBackend = str | Callable
INDUCTOR = "inductor"


def apply_compile(model: nn.Module, fullgraph: bool, backend: CompileBackend = INDUCTOR) -> None:
    """Compiles each block of model.layers in place. MoE blocks pass fullgraph=False where
    their CPU fallback reads token counts on the host (a graph break)."""
    for name, block in list(model.layers.items()):
        model.layers.register_module(
            name, torch.compile(block, fullgraph=fullgraph, backend=backend)
        )
