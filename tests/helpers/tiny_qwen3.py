"""Tiny Qwen3 shapes (dense and MoE) built on the meta device and initialised by name, for unit
tests of the model and of the wrappers around its blocks."""

import dataclasses

import torch

from torchtitan_ablate.models.common.init import ParamInit, canonical_name
from torchtitan_ablate.models.qwen3 import Qwen3Model, Qwen3ModelArgs

ARGS = Qwen3ModelArgs(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=48,
    max_seq_len=32, tie_embeddings=False,
)  # fmt: skip
MOE = dataclasses.replace(ARGS, num_experts=4, top_k=2, moe_hidden_dim=16)


def meta_model(args: Qwen3ModelArgs) -> Qwen3Model:
    with torch.device("meta"):
        return Qwen3Model(args)


def tp_model(args: Qwen3ModelArgs, tp_mesh=None) -> Qwen3Model:
    """`args` built on meta, sharded by apply_tp over `tp_mesh` (if given), then materialised
    on the CPU and initialised by name (seed 0): the same weights with and without TP."""
    from torchtitan_ablate.distributed.tensor_parallel import apply_tp

    model = meta_model(args)
    if tp_mesh is not None:
        apply_tp(model, tp_mesh)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"), init=ParamInit(model, 0, "cpu"))
    return model


def initialised(model: Qwen3Model, seed: int = 7) -> dict[str, torch.Tensor]:
    """Materialises `model` on the CPU, fills it by name from `seed`; its state by canonical
    name."""
    model.to_empty(device="cpu")
    model.init_weights(init=ParamInit(model, seed, "cpu"))
    return {canonical_name(k): v for k, v in model.state_dict().items()}
