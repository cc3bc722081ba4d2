"""Autoregressive decoding of a Qwen3Model with a KV cache: greedy or temperature / top-p sampling.

The training forward (model.py) attends over the whole sequence, so decoding by re-running it
costs a full forward per new token. Here every block's keys and values are kept in a cache and
each step feeds only the new tokens. The step runs the model's own submodules (embedding, per
block the attention projections, q/k norms, RoPE tables, MoE or MLP, final norm, output head),
so the weights and their numerics are the model's; only the attention core is replaced by plain
SDPA of the new queries over the cached keys. model.py's training forward is left untouched.

Shape legend: B batch, L new tokens of this step, S cached positions (including the new ones),
D model dim, H query heads, J kv heads, K head_dim, V vocab, N new tokens in all.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torchtitan_ablate.models.common.rope import apply_rope
from torchtitan_ablate.models.qwen3.model import Attention, Qwen3Model


@dataclass
class KVCache:
    """Per layer, the keys and values of every position fed so far (preallocated)."""

    k_BSJK: list[torch.Tensor]
    v_BSJK: list[torch.Tensor]
    length: int = 0  # positions filled

    @classmethod
    def empty(cls, model: Qwen3Model, batch: int, max_len: int) -> "KVCache":
        a = model.args
        weight = model.tok_embeddings.weight
        shape = (batch, max_len, a.n_kv_heads, a.head_dim)
        k = [weight.new_empty(shape) for _ in range(a.n_layers)]
        v = [weight.new_empty(shape) for _ in range(a.n_layers)]
        return cls(k, v)


def _cached_attention(
    attn: Attention,
    x_BLD: torch.Tensor,
    cos_BLK: torch.Tensor,
    sin_BLK: torch.Tensor,
    k_cache_BSJK: torch.Tensor,
    v_cache_BSJK: torch.Tensor,
    start: int,
) -> torch.Tensor:
    """Attention.forward with the new K/V written into the cache at `start` and the queries
    attending over everything cached up to them."""
    h, j, k_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q_BLHK = attn.q_norm(attn.wq(x_BLD).unflatten(-1, (h, k_dim)))
    k_BLJK = attn.k_norm(attn.wk(x_BLD).unflatten(-1, (j, k_dim)))
    v_BLJK = attn.wv(x_BLD).unflatten(-1, (j, k_dim))
    q_BLHK, k_BLJK = apply_rope(q_BLHK, cos_BLK, sin_BLK), apply_rope(k_BLJK, cos_BLK, sin_BLK)
    end = start + x_BLD.shape[1]
    k_cache_BSJK[:, start:end] = k_BLJK
    v_cache_BSJK[:, start:end] = v_BLJK
    # GQA: each kv head serves h // j consecutive query heads (as the training sdpa path).
    k_BHSK = k_cache_BSJK[:, :end].repeat_interleave(h // j, 2).transpose(1, 2)
    v_BHSK = v_cache_BSJK[:, :end].repeat_interleave(h // j, 2).transpose(1, 2)
    # The query at absolute position start + i sees keys 0 .. start + i.
    pos_S = torch.arange(end, device=x_BLD.device)
    mask_LS = pos_S <= torch.arange(start, end, device=x_BLD.device).unsqueeze(1)
    out_BHLK = F.scaled_dot_product_attention(
        q_BLHK.transpose(1, 2), k_BHSK, v_BHSK, attn_mask=mask_LS
    )
    return attn.wo(out_BHLK.transpose(1, 2).flatten(-2))


def forward_cached(model: Qwen3Model, tokens_BL: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Feeds tokens_BL at the positions after those cached; returns the logits of the last
    one [B, V] (all a decoder needs, and the prefill's [B, L, V] logits are never built)."""
    batch, n_new = tokens_BL.shape
    start = cache.length
    if start + n_new > cache.k_BSJK[0].shape[1]:
        raise ValueError(f"{start + n_new} positions exceed the cache's {cache.k_BSJK[0].shape[1]}")
    pos_BL = torch.arange(start, start + n_new, device=tokens_BL.device).expand(batch, n_new)
    cos_BLK, sin_BLK = model.rope_cos[pos_BL], model.rope_sin[pos_BL]
    h_BLD = model.tok_embeddings(tokens_BL)
    for i, block in enumerate(model.layers.values()):
        attn_BLD = _cached_attention(
            block.attention,
            block.attention_norm(h_BLD),
            cos_BLK,
            sin_BLK,
            cache.k_BSJK[i],
            cache.v_BSJK[i],
            start,
        )
        h_BLD = h_BLD + attn_BLD
        mlp = block.moe if block.moe is not None else block.feed_forward
        h_BLD = h_BLD + mlp(block.ffn_norm(h_BLD))
    cache.length = start + n_new
    return model.output(model.norm(h_BLD[:, -1]))


def sample_next(
    logits_BV: torch.Tensor,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token per row [B]: argmax when temperature is 0, else a draw from
    softmax(logits / temperature) restricted to the smallest set of most likely tokens whose
    probability reaches top_p (nucleus sampling; the most likely token is always kept)."""
    if temperature <= 0:
        return logits_BV.argmax(dim=-1)
    probs_BV = (logits_BV.float() / temperature).softmax(dim=-1)
    if top_p < 1.0:
        sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
        # Drop a token when the more likely ones before it already reach top_p.
        before_BV = sorted_BV.cumsum(dim=-1) - sorted_BV
        sorted_BV = sorted_BV.masked_fill(before_BV >= top_p, 0.0)
        probs_BV = torch.zeros_like(probs_BV).scatter_(-1, order_BV, sorted_BV)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: Qwen3Model,
    prompt_BL: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """New tokens [B, N] after equal-length prompts, N <= max_new_tokens: stops once every row
    has produced eos_id, and a row that has is padded with eos_id after it. Greedy when
    temperature is 0; sampling draws from a generator seeded with `seed` (repeatable)."""
    batch, prompt_len = prompt_BL.shape
    if prompt_len == 0 or max_new_tokens < 1:
        raise ValueError(f"need a prompt and max_new_tokens >= 1, got {prompt_len} tokens and "
                         f"max_new_tokens={max_new_tokens}")  # fmt: skip
    total = prompt_len + max_new_tokens
    if total > model.args.max_seq_len:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's max_seq_len {model.args.max_seq_len} (its RoPE table)"
        )
    generator = torch.Generator(device=prompt_BL.device).manual_seed(seed)
    cache = KVCache.empty(model, batch, total)
    done_B = torch.zeros(batch, dtype=torch.bool, device=prompt_BL.device)
    new_tokens, step_BL = [], prompt_BL
    for _ in range(max_new_tokens):
        next_B = sample_next(forward_cached(model, step_BL, cache), temperature, top_p, generator)
        if eos_id is not None:
            next_B = next_B.masked_fill(done_B, eos_id)
            done_B |= next_B == eos_id
        new_tokens.append(next_B)
        if eos_id is not None and bool(done_B.all()):
            break
        step_BL = next_B.unsqueeze(1)
    return torch.stack(new_tokens, dim=1)
