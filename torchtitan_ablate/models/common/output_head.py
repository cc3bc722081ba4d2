"""The output projection, which can also return the cross-entropy sum directly.

Computing the loss inside the head's own forward keeps FSDP's hooks in charge of its weight
(gathered before, resharded and reduced after) while a loss head (components/objective/loss.py:
chunked, Liger-Kernel, cut cross-entropy) never materialises the [B, S, V] logits. The parameter
stays `output.weight` for checkpoints and the HF adapter.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

LossHead = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(h_BSD, weight_VD, labels_BS) -> float32 cross-entropy sum over labels that are not ignored
(components/objective/loss.py builds them)."""


def whole_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight as the head computes with it: the parameter itself (tensor parallel swaps in
    a gather of its vocabulary shards)."""
    return weight


class OutputHead(nn.Linear):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.weight_fn = whole_weight

    def forward(
        self,
        h_BSD: torch.Tensor,
        labels_BS: torch.Tensor | None = None,
        loss_head: LossHead | None = None,
    ) -> torch.Tensor:
        """Logits [B, S, V]; with labels and a loss head, the head's float32 cross-entropy sum
        over valid labels, from the hidden states and this (gathered) weight."""
        weight_VD = self.weight_fn(self.weight)
        if labels_BS is None:
            return F.linear(h_BSD, weight_VD)
        assert loss_head is not None, "labels_BS needs a loss_head"
        return loss_head(h_BSD, weight_VD, labels_BS)
