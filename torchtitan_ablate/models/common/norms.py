"""RMSNorm as Qwen3 (and HF transformers) computes it.

Shape legend: ... any leading dims, D normalised dim.
"""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm with the statistics taken in float32, then cast back before the weight multiply.

    Normalising in float32 matters for bf16 activations; casting back before multiplying by the
    weight is what HF's Qwen3RMSNorm does, so bf16 runs match it too.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_D: torch.Tensor) -> torch.Tensor:
        normed_D = F.rms_norm(x_D.float(), (x_D.shape[-1],), eps=self.eps)
        return normed_D.type_as(x_D) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
