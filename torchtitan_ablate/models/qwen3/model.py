"""Qwen3 dense and MoE decoder (architecture only), torchtitan module names.

Shape legend: B batch, S sequence, D model dim, H query heads, J kv heads, K head_dim, V vocab.
"""

import torch
from torch import nn

from torchtitan_ablate.models.common.attention import (
    AttentionMask,
    attention,
    build_attention_mask,
)
from torchtitan_ablate.models.common.feed_forward import FeedForward
from torchtitan_ablate.models.common.init import ParamInit, init_for
from torchtitan_ablate.models.common.moe import MoE
from torchtitan_ablate.models.common.norms import RMSNorm
from torchtitan_ablate.models.common.output_head import LossHead, OutputHead
from torchtitan_ablate.models.common.rope import apply_rope, rope_cos_sin
from torchtitan_ablate.models.qwen3.args import Qwen3ModelArgs


class Attention(nn.Module):
    """GQA attention with QK-norm (RMSNorm over head_dim, before RoPE); no biases."""

    def __init__(self, args: Qwen3ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, eps=args.norm_eps)
        # The attention core; context parallel swaps in its all-gather version.
        self.attention_fn = attention

    def forward(
        self, x_BSD: torch.Tensor, cos_BSK: torch.Tensor, sin_BSK: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        # Heads counted from the projection (-1): under tensor parallel a rank holds H / tp.
        q_BSHK = self.q_norm(self.wq(x_BSD).unflatten(-1, (-1, self.head_dim)))
        k_BSJK = self.k_norm(self.wk(x_BSD).unflatten(-1, (-1, self.head_dim)))
        v_BSJK = self.wv(x_BSD).unflatten(-1, (-1, self.head_dim))
        q_BSHK, k_BSJK = apply_rope(q_BSHK, cos_BSK, sin_BSK), apply_rope(k_BSJK, cos_BSK, sin_BSK)
        out_BSHK = self.attention_fn(q_BSHK, k_BSJK, v_BSJK, mask)
        return self.wo(out_BSHK.flatten(-2))

    def init_weights(self, init_std: float, init: ParamInit | None = None) -> None:
        init = init_for(self, init)
        for linear in (self.wq, self.wk, self.wv):
            init.trunc_normal_(linear.weight, 0.02)
        init.trunc_normal_(self.wo.weight, init_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Qwen3ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe: MoE | None = None
        self.feed_forward: FeedForward | None = None
        if args.is_moe_layer(layer_id):
            self.moe = MoE(
                args.dim,
                args.moe_hidden_dim,
                args.num_experts,
                args.top_k,
                norm_topk_prob=args.norm_topk_prob,
                aux_loss_coef=args.moe_aux_loss_coef,
                use_expert_bias=args.moe_bias_update_rate > 0,
                grouped_mm=args.moe_grouped_mm,
                force_load_balance=args.moe_force_load_balance,
            )
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        # torchtitan's depth-scaled init for the projections that write into the residual stream.
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(
        self, x_BSD: torch.Tensor, cos_BSK: torch.Tensor, sin_BSK: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        h_BSD = x_BSD + self.attention(self.attention_norm(x_BSD), cos_BSK, sin_BSK, mask)
        mlp = self.moe if self.moe is not None else self.feed_forward
        return h_BSD + mlp(self.ffn_norm(h_BSD))

    def init_weights(self, init: ParamInit | None = None) -> None:
        init = init_for(self, init)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std, init)
        mlp = self.moe if self.moe is not None else self.feed_forward
        mlp.init_weights(self.init_std, init)


class Qwen3Model(nn.Module):
    def __init__(self, args: Qwen3ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # ModuleDict keyed "0".."n-1" so FSDP / activation checkpointing can wrap per block.
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = OutputHead(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Non-persistent: recomputed by init_weights (after to_empty), never checkpointed.
        cos_SK, sin_SK = rope_cos_sin(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos_SK, persistent=False)
        self.register_buffer("rope_sin", sin_SK, persistent=False)
        # Builds the per-forward mask the attention_fn of every layer reads; context parallel
        # swaps in one that masks this rank's queries against the whole sequence.
        self.build_mask = build_attention_mask

    @torch.no_grad()
    def init_weights(
        self, buffer_device: torch.device | None = None, init: ParamInit | None = None
    ) -> None:
        """Fill every parameter and buffer. Each weight is drawn by `init` from a generator
        seeded by (seed, its name), so its value is the same in every layout (models/common/
        init.py); default: torch's seed, on the device of the weights.

        1. RoPE tables on buffer_device (default: where the buffers live).
        2. Embedding N(0, 1), as torchtitan; tied, it is also the output projection: N(0, 0.02).
           The rows must outweigh the first attention output (about 0.5 per element at
           30B-A3B widths), a context average nearly alike for every token: at 0.02 every
           token sends the first routers almost the same direction and 8 experts of 128 take
           most tokens (dev/routing_study.md).
        3. Per block: norms 1; wq/wk/wv and gates 0.02; projections writing into the residual
           stream, the up projections and the router (as torchtitan) 0.02 / sqrt(2 (layer + 1)).
        4. Final norm 1; untied output truncated N(0, dim^-0.5).
        """
        device = buffer_device if buffer_device is not None else self.rope_cos.device
        cos_SK, sin_SK = rope_cos_sin(
            self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device
        )
        self.rope_cos, self.rope_sin = cos_SK, sin_SK
        init = init_for(self, init)
        # A pipeline stage holds some of the modules (the others are None): it fills those.
        if self.tok_embeddings is not None:
            init.normal_(self.tok_embeddings.weight, 0.02 if self.args.tie_embeddings else 1.0)
        for block in self.layers.values():
            block.init_weights(init)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is None:
            return
        if self.args.tie_embeddings:
            # Re-tie only if something split them (to_empty keeps the shared Parameter); a
            # needless reassignment would swap a parameter FSDP already manages.
            if self.output.weight is not self.tok_embeddings.weight:
                self.output.weight = self.tok_embeddings.weight
        else:
            init.trunc_normal_(self.output.weight, self.args.dim**-0.5)

    def forward_hidden(
        self,
        tokens_BS: torch.Tensor,
        positions_BS: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [B, S, D]; `output` not applied (for chunked losses).
        A pipeline stage (distributed/pipeline_parallel.py) lacks some modules: after the first
        it takes the previous stage's hidden states [B, S, D] as tokens_BS, and before the last
        it returns its blocks' output unnormed."""
        batch, seq_len = tokens_BS.shape[:2]
        if positions_BS is None:
            positions_BS = torch.arange(seq_len, device=tokens_BS.device).expand(batch, seq_len)
        cos_BSK, sin_BSK = self.rope_cos[positions_BS], self.rope_sin[positions_BS]
        mask = self.build_mask(
            self.args.attn_backend, document_ids_BS, batch, seq_len, tokens_BS.device
        )
        h_BSD = self.tok_embeddings(tokens_BS) if self.tok_embeddings is not None else tokens_BS
        for block in self.layers.values():
            h_BSD = block(h_BSD, cos_BSK, sin_BSK, mask)
        return self.norm(h_BSD) if self.norm is not None else h_BSD

    def forward(
        self,
        tokens_BS: torch.Tensor,
        positions_BS: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
        labels_BS: torch.Tensor | None = None,
        loss_head: LossHead | None = None,
    ) -> torch.Tensor:
        """Logits [B, S, V]. document_ids_BS: attend only within a document (packed rows);
        positions_BS then restart per document (the data loader supplies them).
        With labels_BS and loss_head (build_loss_fn's, objective/loss.py): instead the float32
        cross-entropy sum over labels != -100, from the final hidden states and the output
        weight, without the whole batch's logits."""
        h_BSD = self.forward_hidden(tokens_BS, positions_BS, document_ids_BS)
        if self.output is None:  # a pipeline stage before the last
            return h_BSD
        if labels_BS is None:
            return self.output(h_BSD)
        return self.output(h_BSD, labels_BS, loss_head)

    # ---- MoE hooks for the trainer and metrics ---------------------------------------------------

    def moe_layers(self) -> list[MoE]:
        return [block.moe for block in self.layers.values() if block.moe is not None]

    def moe_layer_ids(self) -> list[int]:
        """Indices in the whole model of the MoE layers this model (or pipeline stage) holds,
        in the order of moe_layers() and expert_load()'s rows."""
        return [int(name) for name, block in self.layers.items() if block.moe is not None]

    def moe_aux_loss(self) -> torch.Tensor | None:
        """Sum over MoE layers of the last forward's coefficient-scaled aux loss (detached, for
        logging; its gradient reaches the routers through each layer's output), or None."""
        losses = [moe.aux_loss for moe in self.moe_layers() if moe.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    def set_moe_aux_loss_scale(self, scale: float) -> None:
        """Weight of the aux losses' gradient: 1 / (micro-batches * dp * cp * tp ranks), since
        the trainer sums gradients over ranks and micro-batches."""
        for moe in self.moe_layers():
            moe.aux_loss_scale = scale

    def expert_load(self) -> torch.Tensor | None:
        """Tokens routed to each expert since the last reset, [n_moe_layers, E], or None."""
        moes = self.moe_layers()
        return torch.stack([moe.tokens_per_expert for moe in moes]) if moes else None

    def reset_expert_load(self) -> None:
        for moe in self.moe_layers():
            moe.reset_expert_load()

    def update_expert_bias(self, load_LE: torch.Tensor) -> None:
        """Aux-loss-free balancing step on every MoE layer from their expert loads [L, E] (sum
        them over data-parallel ranks first, or the ranks' biases drift apart)."""
        for moe, load_E in zip(self.moe_layers(), load_LE):
            moe.update_expert_bias(self.args.moe_bias_update_rate, load_E)
