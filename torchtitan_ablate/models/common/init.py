"""Weight-init helpers shared by the model files."""

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake


def trunc_normal_(weight: torch.Tensor, std: float) -> None:
    """Normal(0, std) truncated at 3 std (torchtitan-style init, relative cutoff). A fake
    (shape-only) tensor, as the memory estimator builds, has no values to draw: torch's
    rejection loop would read them on the host."""
    if is_fake(weight):
        return
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
