"""LoRA: low-rank adapters on frozen base weights, for dense projections and routed experts.

`apply_lora(model, rank, alpha, dropout, target_modules)` runs on the meta-device model first in
parallelize_qwen3. Every base parameter keeps its name (`attention.wq.weight`,
`moe.experts.w1`): DCP, the HF adapter and FSDP see the same FQNs, plus the adapter parameters
next to them:
  nn.Linear W [out, in]: swapped to LoRALinear, lora_a [r, in], lora_b [out, r]
  GroupedExperts w [E, out, in]: an ExpertLoRA as its `adapters`, lora_a_w [E, r, in],
    lora_b_w [E, out, r]
The expert adapters are direct parameters of the experts module, so apply_ep shards them
Shard(0) over the ep mesh exactly like the expert weights (E / ep experts' adapters per rank),
and FSDP shards what is left; the experts' compute hands ExpertLoRA its local tensors, whatever
dispatcher moved the rows. Base weights get requires_grad = False: no gradients, no optimizer
state.

Forward: y = x W^T + (alpha / r) * dropout(x) A^T B^T (the adapter runs on activations; the
frozen weight is never copied or merged). B starts at zero, so step 0 equals the base model.
`init_lora_weights` fills A through models/common/init.py (a generator seeded by the seed and
the canonical name): the same values in every layout. `merge_lora_state_dict` folds the
adapters into the base weights for export.

Shape legend: E experts, X rows in expert groups, N / O a projection's input / output dim,
r adapter rank.
"""

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_ablate.config.job_config import LORA_TARGETS
from torchtitan_ablate.models.common.experts import ExpertGroups, GroupedExperts
from torchtitan_ablate.models.common.init import ParamInit, init_for

logger = logging.getLogger("torchtitan_ablate")

EXPERT_WEIGHTS = ("w1", "w2", "w3")


class LoRALinear(nn.Module):
    """A frozen bias-free linear plus a trainable low-rank update. Made by class swap only.

    Deliberately not an nn.Linear subclass: float8 conversion (which matches nn.Linear) leaves
    it alone instead of replacing it with a module that would drop the adapter.
    """

    weight: nn.Parameter
    lora_a: nn.Parameter  # [r, in]
    lora_b: nn.Parameter  # [out, r]
    scale: float
    lora_dropout: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_a), self.lora_b)
        return F.linear(x, self.weight) + self.scale * update

    def extra_repr(self) -> str:
        out_features, in_features = self.weight.shape
        return f"in={in_features}, out={out_features}, rank={self.lora_a.shape[0]}"


class ExpertLoRA(nn.Module):
    """The adapters of a GroupedExperts, added to each of its projections w (w1, w2, w3):
    scale * dropout(x) A_w[e]^T B_w[e]^T for the rows of expert e. A_w, B_w are the experts
    module's own parameters lora_a_w, lora_b_w; its compute passes them in (local shards under
    expert parallel) with the groups the rows sit in."""

    def __init__(self, scale: float, dropout: float) -> None:
        super().__init__()
        self.scale = scale
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(
        self,
        x_XN: torch.Tensor,
        name: str,
        weights: dict[str, torch.Tensor],
        groups: ExpertGroups,
    ) -> torch.Tensor:
        a_ErN, b_EOr = weights[f"lora_a_{name}"], weights[f"lora_b_{name}"]
        if groups.padded:
            # The grouped GEMM needs 16-byte row strides: pad the rank with zero rows (exact).
            pad = -a_ErN.shape[-2] % (16 // a_ErN.element_size())
            a_ErN, b_EOr = F.pad(a_ErN, (0, 0, 0, pad)), F.pad(b_EOr, (0, pad))
        low_Xr = groups.linear(self.lora_dropout(x_XN), a_ErN)
        return self.scale * groups.linear(low_Xr, b_EOr)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


def apply_lora(
    model: nn.Module, rank: int, alpha: float, dropout: float, target_modules: list[str]
) -> int:
    """Adds adapters to `target_modules` of every block and freezes every other parameter.

    The settings are a loaded config's (config/rules.py checked them); `target_modules`
    are names of config's LORA_TARGETS. Returns the number of adapter parameters. Works on any
    device (meta included).
    """
    for p in model.parameters():
        p.requires_grad_(False)
    scale = alpha / rank
    hits = dict.fromkeys(target_modules, 0)
    for block in model.layers.values():
        for target in target_modules:
            module = _find(block, LORA_TARGETS[target])
            if module is None:
                continue
            if isinstance(module, GroupedExperts):
                _add_expert_adapters(module, rank, scale, dropout)
            else:
                _add_linear_adapter(module, rank, scale, dropout)
            hits[target] += 1
    missing = [t for t, n in hits.items() if n == 0]
    if missing and len(model.layers):  # a pipeline stage without blocks has nothing to adapt
        logger.warning(f"lora.target_modules {missing} match no module of this model")
    n_lora = sum(p.numel() for name, p in model.named_parameters() if _is_lora(name))
    logger.info(f"LoRA rank {rank}, alpha {alpha}: {n_lora:,} trainable adapter parameters")
    return n_lora


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Inside, `model` computes its base weights alone (DPO's reference pass): every adapter's
    scale is 0, so its update is multiplied away, exactly (the adapters' own FLOPs, about r / in
    of the base's, are still spent). Restored on exit. No second copy of the weights."""
    kinds = (LoRALinear, ExpertLoRA)
    adapted = [m for m in model.modules() if isinstance(m, kinds)]
    scales = [m.scale for m in adapted]
    for m in adapted:
        m.scale = 0.0
    try:
        yield
    finally:
        for m, scale in zip(adapted, scales):
            m.scale = scale


def lora_parameter_count(
    shapes: list[tuple[int, ...]], rank: int, expert_shapes: list[tuple[int, int, int]] = ()
) -> int:
    """The LoRA formula: r * (in + out) per linear [out, in]; E * r * (in + out) per expert
    weight [E, out, in]."""
    dense = sum(rank * (o + i) for o, i in shapes)
    return dense + sum(e * rank * (o + i) for e, o, i in expert_shapes)


@torch.no_grad()
def init_lora_weights(model: nn.Module, init: ParamInit | None = None) -> None:
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming default), B = 0. `init` (the build path's,
    default: torch's seed) draws each A whole from its name's generator and keeps this rank's
    part, so every layout starts from exactly the one-process adapters."""
    init = init_for(model, init)
    for name, p in model.named_parameters():
        if ".lora_b" in name:
            p.zero_()
        elif ".lora_a" in name:
            init.uniform_(p, 1.0 / math.sqrt(p.shape[-1]))


def merge_lora_state_dict(sd: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """Full (unsharded) native state dict with adapters -> the same without them, each base
    weight W replaced by W + (alpha / r) * B @ A. A state dict without adapters is returned as is.
    """
    out = {k: v for k, v in sd.items() if not _is_lora(k)}
    for key in sd:
        if not key.endswith("lora_a") and ".lora_a_" not in key:
            continue
        if key.endswith(".lora_a"):  # linear: <module>.lora_a -> <module>.weight
            base_key, b_key = key[: -len("lora_a")] + "weight", key[:-1] + "b"
        else:  # experts: <module>.lora_a_w1 -> <module>.w1
            prefix, weight = key.rsplit(".lora_a_", 1)
            base_key, b_key = f"{prefix}.{weight}", f"{prefix}.lora_b_{weight}"
        a, b = sd[key].float(), sd[b_key].float()
        base = sd[base_key]
        out[base_key] = (base.float() + (alpha / a.shape[-2]) * (b @ a)).to(base.dtype)
    return out


# ---- helpers -------------------------------------------------------------------------------------


def _is_lora(name: str) -> bool:
    return ".lora_a" in name or ".lora_b" in name


def _find(block: nn.Module, path: str) -> nn.Module | None:
    module: nn.Module | None = block
    for part in path.split("."):
        module = getattr(module, part, None)
    return module


def _new_param(shape: tuple[int, ...], like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=like.dtype, device=like.device))


def _add_linear_adapter(linear: nn.Module, rank: int, scale: float, dropout: float) -> None:
    if type(linear) is not nn.Linear or linear.bias is not None:
        raise ValueError(f"LoRA needs a bias-free nn.Linear, got {type(linear).__name__}")
    out_features, in_features = linear.weight.shape
    linear.lora_a = _new_param((rank, in_features), linear.weight)
    linear.lora_b = _new_param((out_features, rank), linear.weight)
    linear.scale = scale
    linear.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    linear.__class__ = LoRALinear


def _add_expert_adapters(experts: GroupedExperts, rank: int, scale: float, dropout: float) -> None:
    if experts.adapters is not None:
        raise ValueError("LoRA on experts: these experts already carry adapters")
    for w in EXPERT_WEIGHTS:
        n_experts, out_features, in_features = getattr(experts, w).shape
        base = getattr(experts, w)
        experts.register_parameter(f"lora_a_{w}", _new_param((n_experts, rank, in_features), base))
        experts.register_parameter(f"lora_b_{w}", _new_param((n_experts, out_features, rank), base))
    experts.adapters = ExpertLoRA(scale, dropout)
