"""AdamW/Adam over the model's trainable parameters, in a decay and a no-decay param group.

Which parameters decay (optimizer.no_decay names the classes that do not; default shown):
  decay     every matrix: attention and MLP projections, MoE experts [E, out, in], the router
            gate [E, D], an untied output projection, LoRA adapters
  no decay  norm weights, biases, the token embedding (tied: also the output, the same tensor)

The convention is the HF Trainer's (no decay on biases and LayerNorm/RMSNorm weights) plus the
embedding, which Megatron-LM offers as an option and OLMo 2 drops from decay: a token absent
from a batch gets no gradient, yet decoupled decay still shrinks its row every step, so rare
tokens drift to zero. Decay on a norm gain (initialised at 1) pulls the layer's output scale
towards 0 instead of regularising a matrix. torchtitan puts every parameter in one group and
decays it all; optimizer.no_decay = [] does that.

Classes go by a parameter's module type and name, not its shape (Megatron's "1-D" rule): each
entry of the key means one thing ("bias" is every bias, not every vector), and they hold on
every layout, since fully_shard and apply_ep keep the module tree and names (DTensor numel and
ndim are the global ones). Only trainable parameters are grouped, so under LoRA the frozen base
is left out and the adapters decay unless "lora" is listed.
"""

import logging
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torchtitan_ablate.config.optim_config import NO_DECAY_CLASSES
from torchtitan_ablate.config.optim_config import Optimizer as OptimizerConfig
from torchtitan_ablate.models.common.norms import RMSNorm
from torchtitan_ablate.models.common.output_head import OutputHead

logger = logging.getLogger("torchtitan_ablate")

_NORMS = (RMSNorm, nn.RMSNorm, nn.LayerNorm)
# class -> does (owning module, the parameter's name inside it) belong to it. LoRA: lora.py
# names every adapter lora_a / lora_b (lora_a_w1, ... on experts).
_CLASSES: dict[str, Callable[[nn.Module, str], bool]] = {
    "norm": lambda module, name: isinstance(module, _NORMS),
    "bias": lambda module, name: name == "bias",
    "embedding": lambda module, name: isinstance(module, nn.Embedding),
    "output": lambda module, name: isinstance(module, OutputHead),
    "lora": lambda module, name: name.startswith("lora_"),
}
assert tuple(_CLASSES) == NO_DECAY_CLASSES, "config's NO_DECAY_CLASSES and _CLASSES differ"


def decay_classes(
    model_parts: list[nn.Module], no_decay: list[str]
) -> dict[str, tuple[nn.Parameter, str | None]]:
    """Every trainable parameter once, by FQN (a tied one under its first name), in model
    order: (parameter, the no_decay class that exempts it, or None when it decays). A tied
    parameter is exempt when any module holding it is (the tied output is the embedding)."""
    found: dict[int, tuple[str, nn.Parameter]] = {}
    exempt: dict[int, str] = {}
    for part in model_parts:
        for prefix, module in part.named_modules():
            for name, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    continue
                found.setdefault(id(p), (f"{prefix}.{name}" if prefix else name, p))
                hit = next((c for c in no_decay if _CLASSES[c](module, name)), None)
                if hit is not None:
                    exempt.setdefault(id(p), hit)
    return {fqn: (p, exempt.get(key)) for key, (fqn, p) in found.items()}


def build_optimizer(
    model_parts: list[nn.Module], config: OptimizerConfig, device_type: str
) -> "LocalShardAdam | LocalShardAdamW":
    """One optimizer over every trainable parameter: a group with config.weight_decay and one
    with none (config.no_decay); fused kernels on CUDA by default."""
    classes = decay_classes(model_parts, config.no_decay)
    decay, keep = _split(classes)
    # An empty group is left out: DCP's flattened optimizer state dict cannot load one. Groups
    # carry only torch's own keys, so a checkpoint of a single-group optimizer loads into these
    # (its state is keyed by FQN, and checkpoint/state.py keeps this run's group settings).
    groups = [
        group
        for group in ({"params": decay}, {"params": keep, "weight_decay": 0.0})
        if group["params"]
    ]
    logger.info(describe_groups(classes, config))
    impl = config.implementation
    if impl == "auto":
        impl = "fused" if device_type == "cuda" else "foreach"
    kwargs = dict(
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )
    cls = {"AdamW": LocalShardAdamW, "Adam": LocalShardAdam}[config.name]
    return cls(groups, **kwargs)


class _LocalShardStep:
    """Steps each parameter's local shard: AdamW is elementwise, so a DTensor parameter whose
    gradient and moments share its mesh and placements updates exactly as its local tensors
    do. Stepping DTensors instead sends the fused/foreach kernel through DTensor's dispatch and
    sharding rules on the host, a few ms per step on the critical path (and most of a large
    model's estimate under fake tensors). A group with any other gradient (a Partial one, which
    the DTensor step would all-reduce) is stepped as DTensors, unchanged. The state stays
    DTensors, so checkpoints are the same."""

    def _init_group(self, group: dict, *lists: list) -> bool:
        has_complex = super()._init_group(group, *lists)  # type: ignore[misc]
        params, grads = lists[0], lists[1]
        if all(_same_sharding(p, g) for p, g in zip(params, grads, strict=True)):
            for tensors in lists:
                tensors[:] = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        return has_complex

    @property
    def skips_on_device(self) -> bool:
        """Whether step_unless decides on the device (fused kernels take a skip flag)."""
        return all(group["fused"] for group in self.param_groups)  # type: ignore[attr-defined]

    def step_unless(self, skip: torch.Tensor) -> None:
        """step(), a no-op where the 0-d bool `skip` is true (weights, moments and step counts
        unchanged), decided on the device: the fused kernels take torch's found_inf flag, as
        under GradScaler, so no host read waits for the step. Needs skips_on_device."""
        assert self.skips_on_device, "step_unless needs the fused implementation"
        self.found_inf = skip.float()  # read by torch's Adam.step, for this call only
        try:
            self.step()  # type: ignore[attr-defined]
        finally:
            del self.found_inf


def _same_sharding(param: torch.Tensor, grad: torch.Tensor) -> bool:
    if not isinstance(param, DTensor):
        return not isinstance(grad, DTensor)
    return (
        isinstance(grad, DTensor)
        and grad.device_mesh == param.device_mesh
        and grad.placements == param.placements
    )


class LocalShardAdamW(_LocalShardStep, torch.optim.AdamW):
    """torch.optim.AdamW stepping local shards (_LocalShardStep)."""


class LocalShardAdam(_LocalShardStep, torch.optim.Adam):
    """torch.optim.Adam stepping local shards (_LocalShardStep)."""


def _split(
    classes: dict[str, tuple[nn.Parameter, str | None]],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(parameters that decay, parameters that do not)."""
    decay = [p for p, c in classes.values() if c is None]
    return decay, [p for p, c in classes.values() if c is not None]


def describe_groups(
    classes: dict[str, tuple[nn.Parameter, str | None]], config: OptimizerConfig
) -> str:
    """The start-up line: tensors and parameters (global counts, the same on every layout)
    that decay and that do not, with the rule and how many tensors each class took."""

    def count(ps: list[nn.Parameter]) -> str:
        return f"{len(ps)} tensors ({sum(p.numel() for p in ps):,} parameters)"

    decay, keep = _split(classes)
    if config.weight_decay == 0:
        return f"weight decay: none (optimizer.weight_decay = 0) on {count(decay + keep)}"
    per_class = ", ".join(
        f"{name} {sum(c == name for _, c in classes.values())}" for name in config.no_decay
    )
    rule = f"optimizer.no_decay = {config.no_decay}" + (f": {per_class}" if per_class else "")
    return f"weight decay {config.weight_decay} on {count(decay)}, none on {count(keep)} ({rule})"
