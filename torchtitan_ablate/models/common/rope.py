"""Rotary position embedding, "rotate half" form (HF Llama/Qwen3 convention, not interleaved).

Shape legend: S positions in the cache, B batch, L sequence, H heads, K head_dim.
"""

import torch


def rope_cos_sin(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_seq_len, head_dim] in float32.

    Computed in float32 exactly as HF does (inv_freq times integer positions), so loaded HF
    weights give the same logits; both halves of head_dim share the frequencies.
    """
    exponent_K2 = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq_K2 = 1.0 / (theta**exponent_K2)
    pos_S = torch.arange(max_seq_len, dtype=torch.int64, device=device).float()
    freqs_SK2 = torch.outer(pos_S, inv_freq_K2)
    emb_SK = torch.cat([freqs_SK2, freqs_SK2], dim=-1)
    return emb_SK.cos(), emb_SK.sin()


def _rotate_half(x_BLHK: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BLHK.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x_BLHK: torch.Tensor, cos_BLK: torch.Tensor, sin_BLK: torch.Tensor) -> torch.Tensor:
    """Rotate q or k [B, L, H, K] by per-token angles [B, L, K] (gathered at the positions)."""
    cos_BL1K = cos_BLK.unsqueeze(2).to(x_BLHK.dtype)
    sin_BL1K = sin_BLK.unsqueeze(2).to(x_BLHK.dtype)
    return x_BLHK * cos_BL1K + _rotate_half(x_BLHK) * sin_BL1K
