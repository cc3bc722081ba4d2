"""Dense SwiGLU feed-forward (torchtitan names: w1 gate, w2 down, w3 up).

Shape legend: ... any leading dims, D model dim, F hidden dim.
"""

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_ablate.models.common.init import ParamInit, init_for


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x_D: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_D)) * self.w3(x_D))

    def init_weights(self, init_std: float, init: ParamInit | None = None) -> None:
        # torchtitan: the gate keeps 0.02; up and down get the depth-scaled std.
        init = init_for(self, init)
        init.trunc_normal_(self.w1.weight, 0.02)
        for linear in (self.w2, self.w3):
            init.trunc_normal_(linear.weight, init_std)
