"""torch.compile per transformer block: small graphs compile fast and are reused by every
block of the same shape; FSDP's hooks (applied later) stay outside the graphs."""

import torch
import torch.nn as nn


def apply_compile(model: nn.Module, fullgraph: bool) -> None:
    """Compiles each block of model.layers in place. MoE blocks pass fullgraph=False where
    their CPU fallback reads token counts on the host (a graph break)."""
    for name, block in list(model.layers.items()):
        model.layers.register_module(name, torch.compile(block, fullgraph=fullgraph))
