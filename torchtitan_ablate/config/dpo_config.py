"""The [dpo] section: Direct Preference Optimization, on when training.dataset = "preference".
Names follow TRL's DPOConfig (beta, loss_type, label_smoothing); TRL's max_length is
training.seq_len here. The reference model follows lora.enable: with LoRA, the base model with
the adapters switched off (no second copy); without, a frozen copy of the starting weights,
sharded like the policy. Field docstrings are the reference text, as in job_config.py."""

from dataclasses import dataclass
from typing import Any, Literal

# A DPO step runs each token through the policy's forward and backward (6 FLOPs per parameter)
# and the reference's forward (2 more): the work per token is 4/3 of a training step's.
DPO_FLOPS_FACTOR = 4 / 3


def dpo_enabled(config: Any) -> bool:
    """DPO is on exactly when the data are preference pairs (the one switch)."""
    return config.training.dataset == "preference"


@dataclass
class DPO:
    beta: float = 0.1
    """Strength of the pull towards the reference model (TRL's beta; for ipo, its tau)."""

    loss_type: Literal["sigmoid", "robust", "ipo"] = "sigmoid"
    """As TRL's DPOTrainer: sigmoid: -log sigmoid(beta * margin) (DPO); robust: the
    label-noise-corrected loss with label_smoothing the flip probability (Robust DPO); ipo:
    (margin per response token - 1 / (2 beta))^2 (IPO, TRL's length normalisation)."""

    label_smoothing: float = 0.0
    """robust: probability that a preference label is flipped, in [0, 0.5); other loss types
    take 0."""

    max_bad_rows: int = 0
    """Preference rows that cannot be used (bad JSON, a missing or empty prompt / chosen /
    rejected, or a pair longer than training.seq_len) are counted before training; up to this
    many are skipped (logged with their line numbers), one more stops the run. 0: the first
    bad row stops the run with its file and line."""
