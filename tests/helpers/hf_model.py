"""A tiny random Hugging Face Qwen3 / Qwen3-MoE model, saved as a model folder."""

from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM


def make_hf(kind: str, path: Path, vocab_size: int = 96, seed: int = 0) -> torch.nn.Module:
    """A tiny random Qwen3 ("dense", "dense_tied") or Qwen3-MoE ("moe") saved with
    save_pretrained (hub expert layout); weights scaled so that logits are not all ~0."""
    common = dict(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=80, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=kind == "dense_tied", attn_implementation="eager",
    )  # fmt: skip
    if kind == "moe":
        config = Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, router_aux_loss_coef=0.0,
        )  # fmt: skip
        model = Qwen3MoeForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(path)
    return model.eval()
