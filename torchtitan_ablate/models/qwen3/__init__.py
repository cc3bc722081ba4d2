"""Qwen3 dense and MoE models: sizes, architecture, HF state-dict conversion."""

from torchtitan_ablate.models.qwen3.args import Qwen3ModelArgs, qwen3_flavors
from torchtitan_ablate.models.qwen3.model import Qwen3Model
from torchtitan_ablate.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

__all__ = ["Qwen3Model", "Qwen3ModelArgs", "Qwen3StateDictAdapter", "qwen3_flavors"]
