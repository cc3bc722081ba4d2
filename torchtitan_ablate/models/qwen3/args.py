"""Qwen3 model sizes: the args dataclass, HF config conversion, parameter/FLOP counts, flavors."""

from dataclasses import dataclass, field, replace
from typing import Any

from torchtitan_ablate.models.common.attention import ATTN_BACKENDS


@dataclass
class Qwen3ModelArgs:
    vocab_size: int = 151936
    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 8
    head_dim: int = 128
    hidden_dim: int = 3072  # dense FFN (also the dense layers of an MoE model, if any)
    norm_eps: float = 1e-6
    rope_theta: float = 1e6
    tie_embeddings: bool = False
    max_seq_len: int = 40960
    attn_backend: str = "auto"
    # MoE; num_experts == 0 means dense.
    num_experts: int = 0
    top_k: int = 0
    moe_hidden_dim: int = 0
    norm_topk_prob: bool = True
    moe_aux_loss_coef: float = 0.0
    moe_bias_update_rate: float = 0.0  # > 0: aux-loss-free expert bias (DeepSeek-V3)
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # Routed experts' kernel: None picks grouped GEMM on CUDA bf16, else the per-expert loop;
    # True/False force one (the memory estimator models CUDA's grouped GEMM on CPU).
    moe_grouped_mm: bool | None = None
    # Benchmarks only: round-robin routing, every expert T*K/E rows (debug.moe_force_load_balance).
    moe_force_load_balance: bool = False

    def __post_init__(self) -> None:
        if self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"attn_backend={self.attn_backend!r} is not one of {ATTN_BACKENDS}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads")
        if self.num_experts and not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")

    def is_moe_layer(self, layer_id: int) -> bool:
        """HF's rule: MoE unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
        return (
            self.num_experts > 0
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    # ---- counts ----------------------------------------------------------------------------------

    def num_params(self, *, active: bool = False, embedding: bool = True) -> int:
        """Parameter count from the sizes alone (equals the built model's; no model needed).

        active: count only top_k experts per MoE layer. embedding: include the input embedding
        (when tied, the output projection is the same tensor and counted once, here).
        """
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        per_layer = attn + 2 * self.head_dim + 2 * self.dim  # + q/k norms, 2 block norms
        total = self.dim  # final norm
        for layer_id in range(self.n_layers):
            total += per_layer
            if self.is_moe_layer(layer_id):
                n_exp = self.top_k if active else self.num_experts
                total += self.dim * self.num_experts + 3 * n_exp * self.dim * self.moe_hidden_dim
            else:
                total += 3 * self.dim * self.hidden_dim
        table = self.vocab_size * self.dim
        n_tables = (1 if self.tie_embeddings else 2) - (0 if embedding else 1)
        return total + n_tables * table

    def num_flops_per_token(self, seq_len: int) -> float:
        """6 * N_active (non-embedding, output projection included) + 12 * L * H * K * seq_len."""
        n_active = self.num_params(active=True, embedding=False)
        if self.tie_embeddings:
            n_active += self.vocab_size * self.dim  # the tied output matmul still runs
        return 6.0 * n_active + 12.0 * self.n_layers * self.n_heads * self.head_dim * seq_len

    # ---- HF config -----------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], **overrides: Any) -> "Qwen3ModelArgs":
        """From a hub config.json dict or a transformers 5.x `config.to_dict()`."""
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type={rope_type!r} is not supported (only 'default')")
        # transformers 5 keeps theta under rope_parameters; when absent, its default is 1e4.
        theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
        num_experts = config.get("num_experts", config.get("num_local_experts", 0)) or 0
        n_heads = config["num_attention_heads"]
        kwargs = dict(
            vocab_size=config["vocab_size"],
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
            hidden_dim=config.get("intermediate_size", 0),
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_seq_len=config.get("max_position_embeddings", 40960),
        )
        if num_experts:
            kwargs.update(
                num_experts=num_experts,
                top_k=config["num_experts_per_tok"],
                moe_hidden_dim=config["moe_intermediate_size"],
                norm_topk_prob=bool(config.get("norm_topk_prob", False)),  # HF's default
                moe_aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
                decoder_sparse_step=config.get("decoder_sparse_step", 1),
                mlp_only_layers=list(config.get("mlp_only_layers") or []),
            )
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf_config(self) -> dict[str, Any]:
        """Hub-style config.json dict (Qwen3ForCausalLM or Qwen3MoeForCausalLM)."""
        moe = self.num_experts > 0
        config: dict[str, Any] = {
            "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if moe else "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.hidden_dim,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_seq_len,
            "hidden_act": "silu",
            "attention_bias": False,
        }
        if moe:
            config.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.top_k,
                moe_intermediate_size=self.moe_hidden_dim,
                norm_topk_prob=self.norm_topk_prob,
                router_aux_loss_coef=self.moe_aux_loss_coef,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        return config


def _public(dim: int, n_layers: int, n_heads: int, hidden_dim: int, tie: bool) -> Qwen3ModelArgs:
    return Qwen3ModelArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, hidden_dim=hidden_dim,
        tie_embeddings=tie,
    )  # fmt: skip


def _public_moe(dim: int, n_layers: int, n_heads: int, moe_hidden_dim: int) -> Qwen3ModelArgs:
    # hidden_dim is the hub's intermediate_size; unused while every layer is MoE.
    return Qwen3ModelArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=4, hidden_dim=dim * 3,
        num_experts=128, top_k=8, moe_hidden_dim=moe_hidden_dim, moe_aux_loss_coef=0.001,
    )  # fmt: skip


_DEBUG = Qwen3ModelArgs(
    vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, hidden_dim=768,
    tie_embeddings=True, max_seq_len=2048,
)  # fmt: skip

qwen3_flavors: dict[str, Qwen3ModelArgs] = {
    "debugmodel": _DEBUG,
    "debugmodel_moe": replace(
        _DEBUG, num_experts=8, top_k=2, moe_hidden_dim=256, moe_aux_loss_coef=0.001
    ),
    "0.6B": _public(1024, 28, 16, 3072, tie=True),
    "1.7B": _public(2048, 28, 16, 6144, tie=True),
    "4B": _public(2560, 36, 32, 9728, tie=True),
    "8B": _public(4096, 36, 32, 12288, tie=False),
    "14B": _public(5120, 40, 40, 17408, tie=False),
    "32B": _public(5120, 64, 64, 25600, tie=False),
    "30B-A3B": _public_moe(2048, 48, 32, 768),
    "235B-A22B": _public_moe(4096, 94, 64, 1536),
}
