"""apply_float8 on CPU: which modules convert, loss parity with the high-precision model, device
errors, expert-weight wrapping, and the post-optimizer-step scale precompute under FSDP (1 gloo
rank). The float8 grouped GEMM for experts needs CUDA: that test carries the gpu marker."""

import copy
import dataclasses
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchtitan_ablate.components.quantization.float8 import (
    _convert_experts,
    apply_float8,
    float8_post_optimizer_step,
)
from torchtitan_ablate.config import ConfigError
from torchtitan_ablate.config.job_config import Float8
from torchtitan_ablate.models.common.experts import GroupedExperts
from torchtitan_ablate.models.common.output_head import OutputHead
from torchtitan_ablate.models.qwen3.args import qwen3_flavors
from torchtitan_ablate.models.qwen3.model import Qwen3Model

pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

TINY = dict(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128, vocab_size=256)


def _tiny_args(moe: bool = False):
    if moe:  # layer 0 dense, layer 1 MoE: both kinds of FFN in one model
        return dataclasses.replace(
            qwen3_flavors["debugmodel_moe"], **TINY, n_layers=2, num_experts=4, top_k=2,
            moe_hidden_dim=32, mlp_only_layers=[0],
        )  # fmt: skip
    return dataclasses.replace(qwen3_flavors["debugmodel"], **TINY, n_layers=2)


def _build(args, float8: Float8 | None, seed: int = 0) -> Qwen3Model:
    """The real build path: meta device, convert, to_empty, init_weights."""
    with torch.device("meta"):
        model = Qwen3Model(args)
    if float8 is not None:
        apply_float8(model, float8, "cpu", fsdp_enabled=False)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def test_converts_linears_and_skips_filtered():
    model = _build(_tiny_args(moe=True), Float8(enable=True))
    f8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    expected = {f"layers.{i}.attention.{w}" for i in (0, 1) for w in ("wq", "wk", "wv", "wo")}
    expected |= {f"layers.0.feed_forward.{w}" for w in ("w1", "w2", "w3")}
    assert f8 == expected
    assert type(model.output) is OutputHead and type(model.layers["1"].moe.router.gate) is nn.Linear
    # Tied embeddings survive (output stays high precision, sharing the embedding weight).
    assert model.output.weight is model.tok_embeddings.weight


def test_skips_unaligned_and_filter_names():
    model = nn.ModuleDict(
        {"a": nn.Linear(64, 64), "odd": nn.Linear(64, 24), "head": nn.Linear(64, 64)}
    )
    apply_float8(model, Float8(enable=True, filter_fqns=["head"]), "cpu", fsdp_enabled=False)
    assert isinstance(model["a"], Float8Linear)
    assert type(model["odd"]) is nn.Linear and type(model["head"]) is nn.Linear


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_forward_backward_close_to_high_precision(recipe):
    args = _tiny_args()
    ref, f8 = _build(args, None), _build(args, Float8(enable=True, recipe=recipe))
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    hidden, losses = [], []
    for model in (ref, f8):
        hidden.append(model.forward_hidden(tokens[:, :-1]))
        logits = model.output(hidden[-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[1] - losses[0]) / losses[0] < 0.05, losses
    # The loss of a fresh model is near ln(V) whatever the weights: also bound the hidden states
    # (float8 e4m3 gives about 3% relative error here).
    rel = (hidden[1] - hidden[0]).norm() / hidden[0].norm()
    assert 0 < rel < 0.1, rel
    wq = f8.layers["0"].attention.wq.weight.grad
    assert wq is not None and torch.isfinite(wq).all() and wq.abs().sum() > 0


def test_device_errors():
    # The recipe rules are the loader's (tests/unit/config/test_config_rules.py); the device's
    # are checked here, where the device is known.
    model = nn.Linear(64, 64)
    with pytest.raises(ConfigError, match="float8.moe = true needs CUDA"):
        apply_float8(model, Float8(enable=True, recipe="rowwise", moe=True), "cpu", False)
    with pytest.raises(ConfigError, match="float8.enable = true runs on cuda or cpu, not 'mps'"):
        apply_float8(model, Float8(enable=True), "mps", False)


def test_missing_torchao_gives_pip_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # makes `import torchao` fail
    with pytest.raises(
        ConfigError, match=r"float8.enable = true needs torchao.*pip install torchao="
    ):
        apply_float8(nn.Linear(64, 64), Float8(enable=True), "cpu", fsdp_enabled=False)


def test_expert_weights_wrapped_and_build_path_works():
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor

    with torch.device("meta"):
        model = Qwen3Model(_tiny_args(moe=True))
    skipped: list[str] = []
    assert _convert_experts(model, skipped) == 1 and skipped == []
    model.to_empty(device="cpu")
    model.init_weights()
    experts = model.layers["1"].moe.experts
    for w in (experts.w1, experts.w2, experts.w3):
        assert isinstance(w.data, Float8TrainingWeightWrapperTensor)
        assert torch.isfinite(w.data._data).all() and w.data._data.abs().sum() > 0
    # On CPU the experts take the per-expert loop, which sees plain (high-precision) weights.
    model(torch.randint(0, 256, (1, 16))).sum().backward()
    assert experts.w1.grad is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="float8 grouped GEMM needs CUDA")
def test_experts_float8_grouped_mm_close_to_bf16():
    torch.manual_seed(0)
    ref = GroupedExperts(256, 512, 4).cuda().bfloat16()
    ref.init_weights(0.02)
    f8 = copy.deepcopy(ref)
    apply_float8(f8, Float8(enable=True, recipe="rowwise", moe=True), "cuda", False)
    x = torch.randn(200, 256, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([50, 0, 120, 30], device="cuda")
    outs = [m.run_rows(x, counts) for m in (ref, f8)]
    rel = (outs[1] - outs[0]).float().norm() / outs[0].float().norm()
    assert rel < 0.1, rel
    outs[1].float().pow(2).sum().backward()
    assert torch.isfinite(f8.w1.grad).all()


# FSDP2 warns that the root returns a view (the Linear's output); harmless here.
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_post_optimizer_step_precomputes_scales_under_fsdp():
    from torch.distributed.fsdp import fully_shard

    plain = nn.Linear(32, 32)
    float8_post_optimizer_step(plain)  # no float8 modules: a no-op
    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
        try:
            model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False))
            cfg = Float8(enable=True, enable_fsdp_float8_all_gather=True)
            apply_float8(model, cfg, "cpu", fsdp_enabled=True)
            fully_shard(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model(torch.randn(8, 32)).pow(2).mean().backward()
            opt.step()
            float8_post_optimizer_step(model)
            local = model[0].weight._local_tensor
            assert local._precomputed_scale is not None
        finally:
            dist.barrier()
            dist.destroy_process_group()
