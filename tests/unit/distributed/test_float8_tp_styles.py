"""Which TP styles the float8 linears get: torchao's float8 styles on CUDA, only for converted
linears and for inputs all of whose readers are converted; the plain styles on CPU (gloo cannot
all-gather float8). The plan is built without collectives, and the float8-styles path runs
forward and backward on a fake 2-rank process group (shapes and types only: the numerics of the
CPU path are compared in tests/integration/test_float8_tensor_parallel.py)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from torchtitan_ablate.components.quantization.float8 import apply_float8
from torchtitan_ablate.config.job_config import Float8
from torchtitan_ablate.distributed.float8_tensor_parallel import float8_tp_styles
from torchtitan_ablate.distributed.tensor_parallel import (
    PLAIN,
    _block_plan,
    apply_tp,
    tp_shard_dim,
)
from torchtitan_ablate.models.qwen3 import Qwen3Model, qwen3_flavors

pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.float8_tensor_parallel import (  # noqa: E402
    Float8ColwiseParallel,
    Float8RowwiseParallel,
    PrepareFloat8ModuleInput,
)

LINEARS = {
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
}

# (linear, shard dim, local weight shape at tp 2) of the debug model: wq by output rows, w2 by
# input columns.
SHARDS = (("attention.wq", 0, (128, 256)), ("feed_forward.w2", 1, (256, 384)))


def test_cuda_takes_torchaos_styles_and_cpu_the_plain_ones():
    styles, is_special = float8_tp_styles("cuda")
    assert is_special is Float8Linear
    assert styles.colwise is Float8ColwiseParallel
    assert styles.rowwise is Float8RowwiseParallel
    assert styles.prepare_input is PrepareFloat8ModuleInput
    assert float8_tp_styles("cpu") == (PLAIN, None)


def test_every_converted_linear_and_its_inputs_take_float8_styles():
    plan = _block_plan(dict.fromkeys(LINEARS, float8_tp_styles("cuda")[0]))
    for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1"):
        assert type(plan[name]) is Float8ColwiseParallel
    assert type(plan["attention.wo"]) is Float8RowwiseParallel
    assert type(plan["feed_forward.w2"]) is Float8RowwiseParallel
    assert type(plan["attention"]) is PrepareFloat8ModuleInput
    assert type(plan["feed_forward"]) is PrepareFloat8ModuleInput


def test_a_high_precision_linear_keeps_plain_styles_and_its_input_too():
    # e.g. float8.filter_fqns = ["wk"]: wq / wv still float8, but the attention input they
    # share with wk is gathered in high precision (wk cannot take a float8 input).
    plan = _block_plan(dict.fromkeys(LINEARS - {"attention.wk"}, float8_tp_styles("cuda")[0]))
    assert type(plan["attention.wk"]) is ColwiseParallel
    assert type(plan["attention.wq"]) is Float8ColwiseParallel
    assert type(plan["attention"]) is PrepareModuleInput
    assert type(plan["feed_forward"]) is PrepareFloat8ModuleInput


def test_shard_dims_are_the_same_with_float8_styles():
    # Float8 styles subclass the plain ones: the estimator's shard dims do not change.
    plan = _block_plan(dict.fromkeys(LINEARS, float8_tp_styles("cuda")[0]))
    assert isinstance(plan["attention.wq"], ColwiseParallel)
    assert isinstance(plan["attention.wo"], RowwiseParallel)
    assert tp_shard_dim("layers.0.attention.wq") == 0
    assert tp_shard_dim("layers.0.feed_forward.w2") == 1


def test_float8_styles_run_forward_and_backward_on_a_fake_group():
    # gloo cannot all-gather float8; the fake group moves nothing, so only the plumbing
    # (float8 DTensor casts, redistributes, gradient placements) is checked here.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        args = dataclasses.replace(qwen3_flavors["debugmodel"], n_layers=1)
        with torch.device("meta"):
            model = Qwen3Model(args)
        apply_float8(model, Float8(enable=True), "cpu", fsdp_enabled=True)
        apply_tp(model, mesh, *float8_tp_styles("cuda"))
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
        logits = model(torch.randint(0, args.vocab_size, (2, 32)))
        assert logits.shape == (2, 16, args.vocab_size)  # this rank's S / tp tokens
        logits.float().pow(2).mean().backward()
        block = model.layers["0"]
        for linear, dim, local in SHARDS:
            grad = block.get_submodule(linear).weight.grad
            assert isinstance(grad, DTensor) and grad.placements == (Shard(dim),)
            assert grad.to_local().shape == local
    finally:
        dist.destroy_process_group()
