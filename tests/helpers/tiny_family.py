"""A second model family for tests only, registered as "tiny": its own sizes, model and
parallelize recipe, built through build.py like Qwen3 (test_registry.py).

A pre-norm decoder without position embedding (the causal mask orders the tokens): per block
multi-head attention (models/common/attention.py's kernels) and a SwiGLU MLP. No HF conversion.

Shape legend: B batch, S sequence, D model dim, H heads, K head dim, V vocab.
"""

from dataclasses import dataclass, replace

import torch
from torch import nn

from torchtitan_ablate.components.compile import CompileBackend, apply_compile
from torchtitan_ablate.config import ConfigError, JobConfig
from torchtitan_ablate.config.derived import compiles
from torchtitan_ablate.config.job_config import Model as ModelConfig
from torchtitan_ablate.distributed.activation_checkpoint import apply_ac
from torchtitan_ablate.distributed.fsdp import AccumulationPlan, apply_fsdp
from torchtitan_ablate.distributed.parallel_dims import ParallelDims
from torchtitan_ablate.models.common.attention import attention, build_attention_mask
from torchtitan_ablate.models.common.feed_forward import FeedForward
from torchtitan_ablate.models.common.init import ParamInit, init_for
from torchtitan_ablate.models.common.norms import RMSNorm
from torchtitan_ablate.models.common.output_head import LossHead, OutputHead
from torchtitan_ablate.models.spec import ModelSpec


@dataclass
class TinyArgs:
    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 3
    n_heads: int = 2
    hidden_dim: int = 48
    attn_backend: str = "sdpa"
    num_experts: int = 0  # dense

    def num_params(self) -> int:
        """Embedding and output tables, per block 4 D^2 attention + 3 D F MLP + 2 norms, final
        norm: what TinyModel(self) holds."""
        d = self.dim
        per_block = 4 * d * d + 3 * d * self.hidden_dim + 2 * d
        return 2 * self.vocab_size * d + self.n_layers * per_block + d

    def num_flops_per_token(self, seq_len: int) -> float:
        n = self.num_params() - self.vocab_size * self.dim  # the input table does no matmul
        return 6.0 * n + 12.0 * self.n_layers * self.dim * seq_len


TINY_FLAVORS = {"small": TinyArgs()}


class TinyBlock(nn.Module):
    def __init__(self, args: TinyArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.attention_norm = RMSNorm(args.dim)
        self.wqkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        self.ffn_norm = RMSNorm(args.dim)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(self, x_BSD: torch.Tensor, mask) -> torch.Tensor:
        qkv = self.wqkv(self.attention_norm(x_BSD)).unflatten(-1, (3, self.n_heads, -1))
        out_BSHK = attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], mask)
        h_BSD = x_BSD + self.wo(out_BSHK.flatten(-2))
        return h_BSD + self.feed_forward(self.ffn_norm(h_BSD))

    def init_weights(self, init: ParamInit) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        init.trunc_normal_(self.wqkv.weight, 0.02)
        init.trunc_normal_(self.wo.weight, 0.02)
        self.feed_forward.init_weights(0.02, init)


class TinyModel(nn.Module):
    def __init__(self, args: TinyArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TinyBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim)
        self.output = OutputHead(args.dim, args.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(
        self, buffer_device: torch.device | None = None, init: ParamInit | None = None
    ) -> None:
        init = init_for(self, init)
        init.normal_(self.tok_embeddings.weight, 0.02)
        for block in self.layers.values():
            block.init_weights(init)
        self.norm.reset_parameters()
        init.trunc_normal_(self.output.weight, self.args.dim**-0.5)

    def forward(
        self,
        tokens_BS: torch.Tensor,
        positions_BS: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
        labels_BS: torch.Tensor | None = None,
        loss_head: LossHead | None = None,
    ) -> torch.Tensor:
        batch, seq_len = tokens_BS.shape
        mask = build_attention_mask(
            self.args.attn_backend, document_ids_BS, batch, seq_len, tokens_BS.device
        )
        h_BSD = self.tok_embeddings(tokens_BS)
        for block in self.layers.values():
            h_BSD = block(h_BSD, mask)
        h_BSD = self.norm(h_BSD)
        if labels_BS is None:
            return self.output(h_BSD)
        return self.output(h_BSD, labels_BS, loss_head)

    # A dense family's side of the train step's MoE hooks.
    def set_moe_aux_loss_scale(self, scale: float) -> None:
        pass

    def moe_aux_loss(self) -> torch.Tensor | None:
        return None


def build_tiny_args(
    model: ModelConfig, seq_len: int, initial_load_path: str | None, force_balance: bool
) -> TinyArgs:
    if force_balance:
        raise ConfigError("debug.moe_force_load_balance = true: the tiny family has no experts")
    if model.flavor not in TINY_FLAVORS:
        raise ConfigError(f"model.flavor = {model.flavor!r}: one of {', '.join(TINY_FLAVORS)}")
    return replace(TINY_FLAVORS[model.flavor], attn_backend=model.attn_backend)


def parallelize_tiny(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device_type: str,
    compile_backend: CompileBackend,
) -> tuple[list[nn.Module], AccumulationPlan | None]:
    """Activation checkpointing, compile per block, then FSDP over every data-parallel rank
    (float32 throughout); the model is its one part (no pipeline parallel)."""
    ac = job_config.activation_checkpoint
    if ac.mode != "none":
        apply_ac(model, ac.mode, ac.selective_ac_option)
    if compiles(job_config.compile, "model"):
        apply_compile(model, fullgraph=True, backend=compile_backend)
    if parallel_dims.dp == 1:
        return [model], None
    plan = apply_fsdp(
        model,
        parallel_dims.mesh("fsdp"),
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward,
    )
    return [model], plan


TINY_SPEC = ModelSpec(
    name="tiny",
    model_cls=TinyModel,
    args_cls=TinyArgs,
    flavors=TINY_FLAVORS,
    build_args=build_tiny_args,
    parallelize=parallelize_tiny,
)
