"""Weight-init helpers shared by the model files."""

import torch
from torch import nn


def trunc_normal_(weight: torch.Tensor, std: float) -> None:
    """Normal(0, std) truncated at 3 std (torchtitan-style init, relative cutoff)."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
