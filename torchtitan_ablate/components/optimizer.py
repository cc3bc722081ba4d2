"""AdamW/Adam over the model's trainable parameters."""

import torch
import torch.nn as nn

from torchtitan_ablate.config.job_config import Optimizer as OptimizerConfig


def build_optimizer(
    model_parts: list[nn.Module], config: OptimizerConfig, device_type: str
) -> torch.optim.Optimizer:
    """One optimizer over every trainable parameter; fused kernels on CUDA by default."""
    params = [p for m in model_parts for p in m.parameters() if p.requires_grad]
    impl = config.implementation
    if impl == "auto":
        impl = "fused" if device_type == "cuda" else "foreach"
    kwargs = dict(
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[config.name]
    return cls(params, **kwargs)
