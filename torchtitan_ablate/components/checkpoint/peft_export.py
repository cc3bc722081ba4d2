"""LoRA adapters of a checkpoint in Hugging Face PEFT's layout: what
`scripts/convert_checkpoint.py --to hf --peft PEFT_DIR` writes besides the merged weights.

PEFT's folder holds adapter_config.json and adapter_model.safetensors; it loads on the HF base
model with `peft.PeftModel.from_pretrained(base, PEFT_DIR)`. Our adapters already have
nn.Linear's orientation (A maps in -> r, B maps r -> out), so they are renamed only:
  layers.{i}.attention.wq.lora_a    [r, in]
      -> base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight
  layers.{i}.feed_forward.w1.lora_b [out, r]
      -> base_model.model.model.layers.{i}.mlp.gate_proj.lora_B.weight
PEFT's LoRA (use_rslora false) adds (lora_alpha / r) * B @ A to W, as our merge does.
Adapters on routed experts (target "experts") have no PEFT layout for Qwen3-MoE: refused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from torchtitan_ablate.components.checkpoint.export_folder import as_umask_allows
from torchtitan_ablate.components.checkpoint.offline_weights import LORA_ADAPTER_KEY
from torchtitan_ablate.models.spec import StateDictAdapter

_LINEAR_ADAPTER = re.compile(r"^(layers\.\d+\..+)\.lora_([ab])$")


def peft_state_dict(
    state: dict[str, torch.Tensor], adapter: StateDictAdapter
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Native state dict (base + adapters) -> (PEFT adapter tensors, the HF paths that carry
    them, e.g. model.layers.0.self_attn.q_proj: the state-dict adapter's name of the adapted
    weight). ValueError for expert adapters or none."""
    adapters = [k for k in state if LORA_ADAPTER_KEY.search(k)]
    experts = [k for k in adapters if not _LINEAR_ADAPTER.match(k)]
    if experts:
        raise ValueError(
            f"the routed experts carry LoRA adapters ({experts[0]}; lora.target_modules has "
            '"experts"), which have no PEFT layout for Qwen3-MoE: export the merged weights '
            "(--to hf without --peft)"
        )
    if not adapters:
        raise ValueError("--peft: the checkpoint holds no LoRA adapters (lora.enable was off)")
    tensors, modules = {}, set()
    for key in sorted(adapters):
        module, ab = _LINEAR_ADAPTER.match(key).groups()
        path = adapter.hf_key(f"{module}.weight").removesuffix(".weight")
        # PeftModel.base_model (LoraModel) .model (ForCausalLM) .model (Qwen3Model)
        tensors[f"base_model.model.{path}.lora_{ab.upper()}.weight"] = state[key]
        modules.add(path)
    return tensors, sorted(modules)


def peft_config(
    rank: int, alpha: float, dropout: float, targets: list[str], base_model: str | None
) -> dict:
    """adapter_config.json of a LoRA for causal LM that PEFT's LoraConfig reads."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": targets,
        "bias": "none",
        "base_model_name_or_path": base_model,
        "inference_mode": True,
        "fan_in_fan_out": False,  # our weights are [out, in], like nn.Linear's
        "use_rslora": False,  # scale alpha / r, not alpha / sqrt(r)
        "modules_to_save": None,
    }


def save_peft_adapters(
    state: dict[str, torch.Tensor],
    out_dir: Path,
    adapter: StateDictAdapter,
    *,
    alpha: float,
    dropout: float,
    base_model: str | None,
    is_moe: bool,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Writes adapter_config.json + adapter_model.safetensors into out_dir; returns the names."""
    tensors, modules = peft_state_dict(state, adapter)
    ranks = {t.shape[0] for k, t in tensors.items() if ".lora_A." in k}
    assert len(ranks) == 1, f"adapters of several ranks {sorted(ranks)}"
    # PEFT matches target_modules as name suffixes. On an MoE model "gate_proj" would also hit
    # every expert's gate_proj, so there the exact module paths are listed instead.
    if is_moe:
        targets = modules
    else:
        targets = sorted({m.rsplit(".", 1)[1] for m in modules})
    config = peft_config(ranks.pop(), alpha, dropout, targets, base_model)
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: (t.to(dtype) if dtype else t).contiguous() for k, t in tensors.items()}
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    as_umask_allows(out_dir / "adapter_model.safetensors")  # safetensors writes 0600
    return ["adapter_config.json", "adapter_model.safetensors"]
