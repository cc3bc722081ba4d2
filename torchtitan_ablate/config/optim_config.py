"""The [optimizer] and [lr_scheduler] sections. Field docstrings are the reference text, as in
job_config.py."""

from dataclasses import dataclass, field
from typing import Literal

# optimizer.no_decay: the parameter classes that components/optim/optimizer.py can exempt from
# weight decay.
NO_DECAY_CLASSES = ("norm", "bias", "embedding", "output", "lora")


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimizer. AdamW decays weights decoupled from the gradient; Adam adds weight_decay * w
    to the gradient (L2), as torch.optim.Adam does."""

    lr: float = 1e-3
    """Peak learning rate."""

    beta1: float = 0.9
    """Adam beta1."""

    beta2: float = 0.95
    """Adam beta2."""

    eps: float = 1e-8
    """Adam epsilon."""

    weight_decay: float = 0.1
    """Weight decay (decoupled for AdamW, L2 for Adam); see no_decay for what it skips."""

    no_decay: list[str] = field(default_factory=lambda: ["norm", "bias", "embedding"])
    """Parameter classes that get no weight decay: norm (RMSNorm / LayerNorm weights), bias
    (every bias), embedding (the token embedding; with tied embeddings the output projection
    is the same tensor), output (the untied output projection), lora (the LoRA adapters).
    Every other trainable parameter decays: projections, MoE experts, the router, the adapters.
    [] decays everything (torchtitan's default). The start-up log states the split."""

    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    """auto: fused on CUDA, foreach on CPU."""


@dataclass
class LRScheduler:
    warmup_steps: int = 5
    """Linear warmup from ~0 to optimizer.lr over this many steps."""

    warmup_ratio: float | None = None
    """Warmup as a fraction of training.steps (HF's name): ceil(warmup_ratio x steps) steps,
    from the final step count (the one training.epochs derives too). Set it or warmup_steps,
    not both in one place (the command line overrides the recipe's)."""

    decay_ratio: float | None = None
    """Fraction of the steps spent decaying at the end (WSD); None = decay over all steps
    after warmup."""

    decay_type: Literal["linear", "cosine", "sqrt"] = "linear"
    """Shape of the decay."""

    min_lr_factor: float = 0.0
    """Final learning rate as a fraction of optimizer.lr."""
