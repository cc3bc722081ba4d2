"""The output projection, which can also return the cross-entropy sum directly.

Computing the loss inside the head's own forward keeps FSDP's hooks in charge of its weight
(gathered before, resharded and reduced after) while the chunked loss never materialises the
[B, S, V] logits. The parameter stays `output.weight` for checkpoints and the HF adapter.
"""

import torch
from torch import nn

from torchtitan_ablate.components.loss import chunked_linear_cross_entropy_sum


class OutputHead(nn.Linear):
    def forward(
        self,
        h_BSD: torch.Tensor,
        labels_BS: torch.Tensor | None = None,
        chunk_size: int = 0,
        compiled: bool = False,
    ) -> torch.Tensor:
        """Logits [B, S, V]; with labels, the float32 cross-entropy sum over valid labels,
        computed chunk_size tokens at a time. compiled: each chunk's softmax and gradient fused
        (no float32 copy of the chunk's logits)."""
        if labels_BS is None:
            return super().forward(h_BSD)
        return chunked_linear_cross_entropy_sum(
            h_BSD, self.weight, labels_BS, chunk_size, compiled=compiled
        )
