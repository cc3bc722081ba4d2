"""ModelSpec: what the engine needs from a model family (torchtitan's TrainSpec, reduced to what
this engine reads). A family lives in models/<name>/ and lists its spec in models/registry.py;
build.py, the checkpoint tools, the estimator and the scripts reach it through the registry.

The contract a family meets, beyond the fields below:
- Its args (one dataclass per family, `args_cls`) carry `vocab_size`, `num_experts` (0: dense),
  `attn_backend` and `num_flops_per_token(seq_len)`; MoE families also `moe_bias_update_rate`
  and `moe_grouped_mm` (the routed experts' kernel, which the estimator forces).
- Its model (`model_cls(args)`, built on the meta device) keeps `args`; holds `tok_embeddings`,
  `layers` (an nn.ModuleDict of blocks: what activation checkpointing, compile and FSDP wrap),
  `norm` and `output` (an OutputHead); fills itself in `init_weights(buffer_device, init)`;
  runs `forward(tokens, positions, document_ids, labels_BS=None, loss_head=None)`; and has the
  MoE hooks the train step calls through components/rank_moe.py (`set_moe_aux_loss_scale`,
  `moe_aux_loss`; for MoE also `expert_load`, `reset_expert_load`, `update_expert_bias` and
  `moe_layer_ids`, the whole-model indices of the layers a pipeline stage holds).
- Its `parallelize(model, parallel_dims, job_config, device_type, compile_backend)` applies the
  techniques in place (through distributed/ and components/) and returns this rank's model
  parts (the model itself, or its pipeline stages) and FSDP's AccumulationPlan (None without
  FSDP). Tensor parallel is applied only by families that
  declare `tp_split`; build.py refuses tensor_parallel_degree > 1 for the others.
"""

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from torchtitan_ablate.config.job_config import Model as ModelConfig

Region = tuple[slice, ...]
"""A part of a tensor in its global coordinates (one slice per dimension)."""

ReadHF = Callable[[str, Region], torch.Tensor]
"""(HF tensor name, region) -> that region of the tensor, read from the checkpoint files."""


class StateDictAdapter(Protocol):
    """A family's native <-> Hugging Face state-dict conversion, for one model's sizes."""

    def native_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every persistent entry of the model's state_dict() with its shape."""

    def tied_keys(self) -> dict[str, str]:
        """Entries that are another entry's tensor ({alias: source}), which checkpoints may
        store once under the source's name."""

    def no_hf_counterpart(self, key: str) -> bool:
        """A native entry that HF checkpoints lack (it keeps its initial value on load)."""

    def hf_layout(self, hf_keys: Iterable[str]) -> str:
        """The layout of an HF checkpoint holding these names (families with one: "hub")."""

    def hf_accepted(self, layout: str) -> tuple[dict[str, tuple[int, ...]], set[str]]:
        """Every name and shape an HF checkpoint in `layout` may hold, and which may be absent."""

    def hf_reader(self, key: str, layout: str, read: ReadHF) -> Callable[[Region], torch.Tensor]:
        """A function giving any region of native entry `key` from the HF tensors."""

    def hf_key(self, key: str) -> str:
        """The HF name of a native entry that maps to one HF tensor (LoRA's targets do)."""

    def hf_config(self, source: dict[str, Any] | None = None) -> dict[str, Any]:
        """config.json for these sizes: `source` (an HF config.json) with ours on top."""

    def to_hf(self, native_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Native -> HF, in the layout the hub holds."""

    def from_hf(self, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF (any layout) -> native, ready for load_state_dict(strict=True)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    """The model.name that selects this family."""

    model_cls: Callable[[Any], nn.Module]
    """model_cls(args): the model of these sizes on the current device (the module docstring)."""

    args_cls: type
    """The family's sizes dataclass; with HF support it has `from_hf_config(config_dict)`."""

    flavors: Mapping[str, Any]
    """Named sizes (model.flavor)."""

    build_args: Callable[[ModelConfig, int, str | None, bool], Any]
    """(model section, training.seq_len, checkpoint.initial_load_path,
    debug.moe_force_load_balance) -> this run's args, or ConfigError naming the key (a family
    without routed experts refuses the last)."""

    parallelize: Callable[..., Any]
    """The family's recipe of techniques (the module docstring)."""

    state_dict_adapter: Callable[[Any], StateDictAdapter] | None = None
    """args -> the HF conversion (HF weights, checkpoint conversion, generation from DCP)."""

    hf_model_types: tuple[str, ...] = ()
    """The config.json "model_type" values this family reads."""

    tp_split: Callable[[Any], dict[str, int]] | None = None
    """args -> the sizes tensor parallel splits ({"n_heads": 16, ...}), each of which
    parallelism.tensor_parallel_degree must divide; None: the family has no tensor parallel."""

    generate: Callable[..., torch.Tensor] | None = None
    """Decoding: (model, prompt_BL, max_new_tokens, temperature, top_p, eos_id, seed) -> new
    tokens [B, N] (scripts/generate.py)."""
