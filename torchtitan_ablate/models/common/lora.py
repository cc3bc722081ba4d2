"""LoRA: low-rank adapters on frozen base weights, for dense projections and routed experts.

`apply_lora(model, rank, alpha, dropout, target_modules)` runs on the meta-device model first in
parallelize_qwen3. It swaps classes in place (as apply_ep and FSDP2 do), so every base
parameter keeps its name (`attention.wq.weight`, `moe.experts.w1`): DCP, the HF adapter and FSDP
see the same FQNs, plus the adapter parameters next to them:
  nn.Linear W [out, in]          -> LoRALinear      lora_a [r, in], lora_b [out, r]
  GroupedExperts w [E, out, in]  -> LoRAGroupedExperts  lora_a_w [E, r, in], lora_b_w [E, out, r]
The adapters are direct parameters of the experts module, so apply_ep shards them Shard(0) over
the ep mesh exactly like the expert weights (E / ep experts' adapters per rank), and FSDP shards
what is left. Base weights get requires_grad = False: no gradients, no optimizer state.

Forward: y = x W^T + (alpha / r) * dropout(x) A^T B^T (the adapter runs on activations; the
frozen weight is never copied or merged). B starts at zero, so step 0 equals the base model.
`init_lora_weights` fills A through models/common/init.py (a generator seeded by the seed and
the canonical name): the same values in every layout. `merge_lora_state_dict` folds the
adapters into the base weights for export.

Shape legend: E experts, I expert hidden dim, D model dim, R routed rows, r adapter rank.
"""

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_ablate.config.job_config import LORA_TARGETS
from torchtitan_ablate.distributed.expert_parallel import ExpertParallelExperts
from torchtitan_ablate.models.common.experts import (
    GroupedExperts,
    count_reader,
    in_expert_order,
    pad_by_expert,
)
from torchtitan_ablate.models.common.init import ParamInit, init_for
from torchtitan_ablate.models.common.permute import gather_rows

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


class LoRAGroupedExperts(GroupedExperts):
    """GroupedExperts with one adapter per expert and weight. Made by class swap only."""

    scale: float
    lora_dropout: nn.Module

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        return lora_experts(self, _weights(self), x_RD, num_tokens_per_expert_E)


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
    if missing:
        logger.warning(f"lora.target_modules {missing} match no module of this model")
    n_lora = sum(p.numel() for name, p in model.named_parameters() if _is_lora(name))
    logger.info(f"LoRA rank {rank}, alpha {alpha}: {n_lora:,} trainable adapter parameters")
    return n_lora


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Inside, `model` computes its base weights alone (DPO's reference pass): every adapter's
    scale is 0, so its update is multiplied away, exactly (the adapters' own FLOPs, about r / in
    of the base's, are still spent). Restored on exit. No second copy of the weights."""
    kinds = (LoRALinear, LoRAGroupedExperts, LoRAExpertParallelExperts)
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


def lora_experts(
    experts: GroupedExperts,
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    x_RD: torch.Tensor,
    counts_E: torch.Tensor,
    rank_R: torch.Tensor | None = None,
) -> torch.Tensor:
    """SwiGLU experts with adapters. weights[w] = (base [E, out, in], A [E, r, in], B [E, out, r])
    for w in w1 (gate), w3 (up), w2 (down); the same exact paths as GroupedExperts (rank_R as
    there: rows in any order, with their rank in expert order)."""
    drop, scale = experts.lora_dropout, experts.scale
    if experts.runs_grouped_mm(x_RD):
        x_PD, dest_R, offs_E = pad_by_expert(x_RD, counts_E, rank_R)

        def proj(x: torch.Tensor, w: str) -> torch.Tensor:
            base, a, b = weights[w]
            # The kernel needs 16-byte row strides: pad the rank with zero rows (exact).
            pad = -a.shape[-2] % (16 // a.element_size())
            a, b = F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))
            t = lambda m: m.transpose(-2, -1)  # noqa: E731
            low = torch._grouped_mm(drop(x), t(a), offs=offs_E)
            return torch._grouped_mm(x, t(base), offs=offs_E) + scale * torch._grouped_mm(
                low, t(b), offs=offs_E
            )

        h_PI = F.silu(proj(x_PD, "w1")) * proj(x_PD, "w3")
        return gather_rows(proj(h_PI, "w2"), dest_R)

    def run(x_RD: torch.Tensor) -> torch.Tensor:
        out_RD = []
        splits = count_reader().expert_splits(counts_E, x_RD.shape[0])
        for e, x_rD in enumerate(torch.split(x_RD, splits, dim=0)):

            def proj_e(x: torch.Tensor, w: str, e: int = e) -> torch.Tensor:
                base, a, b = weights[w]
                return x @ base[e].T + scale * ((drop(x) @ a[e].T) @ b[e].T)

            h_rI = F.silu(proj_e(x_rD, "w1")) * proj_e(x_rD, "w3")
            out_RD.append(proj_e(h_rI, "w2"))
        return torch.cat(out_RD, dim=0)

    return in_expert_order(run, x_RD, rank_R)


class LoRAExpertParallelExperts(ExpertParallelExperts):
    """ExpertParallelExperts whose local experts carry their adapters (see make_ep_lora_experts)."""

    scale: float
    lora_dropout: nn.Module

    def _local_experts(
        self, x_ND: torch.Tensor, counts_L: torch.Tensor, rank_N: torch.Tensor
    ) -> torch.Tensor:
        local = {w: tuple(_local(t) for t in ws) for w, ws in _weights(self).items()}
        return lora_experts(self, local, x_ND, counts_L, rank_N)


def make_ep_lora_experts(model: nn.Module) -> None:
    """Call right after apply_ep: it swapped every experts module's class to
    ExpertParallelExperts (route: dispatch, local compute, combine), which would drop the
    adapters from the compute; this keeps its route and runs the local experts with their
    adapters."""
    for block in model.layers.values():
        experts = getattr(getattr(block, "moe", None), "experts", None)
        if type(experts) is ExpertParallelExperts and hasattr(experts, "lora_a_w1"):
            experts.__class__ = LoRAExpertParallelExperts


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
    if type(experts) is not GroupedExperts:
        raise ValueError(f"LoRA on experts needs GroupedExperts, got {type(experts).__name__}")
    for w in EXPERT_WEIGHTS:
        n_experts, out_features, in_features = getattr(experts, w).shape
        base = getattr(experts, w)
        experts.register_parameter(f"lora_a_{w}", _new_param((n_experts, rank, in_features), base))
        experts.register_parameter(f"lora_b_{w}", _new_param((n_experts, out_features, rank), base))
    experts.scale = scale
    experts.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    experts.__class__ = LoRAGroupedExperts


def _weights(experts: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return {
        w: (getattr(experts, w), getattr(experts, f"lora_a_{w}"), getattr(experts, f"lora_b_{w}"))
        for w in EXPERT_WEIGHTS
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
