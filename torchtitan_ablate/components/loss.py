"""Token cross-entropy as a sum; the trainer divides by the global count of valid tokens so
that gradient accumulation and every data-parallel layout give the same gradient."""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy (float32) over labels != IGNORE_INDEX."""
    return F.cross_entropy(
        logits_BSV.flatten(0, 1).float(),
        labels_BS.flatten(0, 1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def num_valid_tokens(labels_BS: torch.Tensor) -> torch.Tensor:
    return (labels_BS != IGNORE_INDEX).sum()
