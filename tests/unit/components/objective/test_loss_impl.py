"""training.loss_impl: which loss each setting builds, its config rules, the one-line errors of
the kernel losses (missing package, no CUDA), and on a GPU that Liger-Kernel's and cut
cross-entropy's loss and gradients match the plain loss."""

import dataclasses
import importlib.util

import pytest
import torch

from torchtitan_ablate.build import build_loss_fn
from torchtitan_ablate.components.objective import loss as loss_module
from torchtitan_ablate.components.objective.loss import (
    IGNORE_INDEX,
    check_kernel_loss,
    cross_entropy_sum,
    kernel_loss_head,
)
from torchtitan_ablate.config import ConfigError, load_config
from torchtitan_ablate.models.qwen3 import Qwen3Model, qwen3_flavors


def _config(*args: str):
    return load_config(["--model.flavor", "debugmodel", *args])


def _tiny_model() -> Qwen3Model:
    args = dataclasses.replace(
        qwen3_flavors["debugmodel"], dim=32, n_heads=2, n_kv_heads=1, head_dim=16,
        hidden_dim=64, n_layers=1, vocab_size=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3Model(args)
    model.init_weights()
    return model


def _batch() -> dict:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (2, 12), generator=g)
    labels = torch.randint(0, 64, (2, 12), generator=g)
    labels[1, -3:] = IGNORE_INDEX
    pos = torch.arange(12).expand(2, 12)
    return {"input_ids": tokens, "labels": labels, "positions": pos, "document_ids": None}


@pytest.mark.parametrize(
    "args",
    [
        [],  # auto with the default chunk size: chunked
        ["--training.loss_chunk_size", "0"],  # auto, 0: plain (TOMLs from before loss_impl)
        ["--training.loss_impl", "plain"],
        ["--training.loss_impl", "chunked", "--training.loss_chunk_size", "5"],
    ],
)
def test_each_builtin_impl_gives_the_plain_loss(args):
    model, batch = _tiny_model(), _batch()
    ref = cross_entropy_sum(model(batch["input_ids"]), batch["labels"])
    got = build_loss_fn(_config(*args))(model, batch)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-6)


@pytest.mark.parametrize(
    "args, match",
    [
        (["--training.loss_impl", "chunked", "--training.loss_chunk_size", "0"], "chunk_size > 0"),
        (["--training.loss_impl", "cce", "--training.device", "cpu"], "needs CUDA"),
        (["--training.loss_impl", "fused"], "training.loss_impl"),
        (
            ["--training.loss_impl", "cce", "--training.mixed_precision_param", "float32"],
            "trains bf16 hidden states only",
        ),
        (["--training.throughput_noise_target", "2"], "throughput_noise_target"),
    ],
)  # fmt: skip
def test_contradictions_are_one_line_config_errors(args, match):
    with pytest.raises(ConfigError, match=match) as e:
        _config(*args)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("impl, extra", [("liger", "liger"), ("cce", "cce")])
def test_kernel_loss_without_its_package_names_the_extra(impl, extra, monkeypatch):
    real = importlib.util.find_spec
    module = loss_module.KERNEL_LOSSES[impl][0]
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a)
    )
    with pytest.raises(ConfigError, match=rf"pip install -e \.\[{extra}\]"):
        check_kernel_loss(impl)


@pytest.mark.parametrize("impl", ["liger", "cce"])
def test_kernel_loss_refuses_cpu_tensors_with_a_config_error(impl):
    # Without a stand-in (the memory estimator installs its own: kernel_loss_with), CPU
    # tensors get one config-error line instead of a Triton crash.
    h, w = torch.zeros(1, 4, 8), torch.zeros(16, 8)
    with pytest.raises(ConfigError, match="CUDA kernel"):
        kernel_loss_head(impl)(h, w, torch.zeros(1, 4, dtype=torch.long))


def _kernel_vs_plain(impl: str) -> tuple:
    """Loss and gradients (h, W) of `impl` and of the plain loss on the same bf16 inputs at
    Qwen's vocabulary size: logits of std 1 (an untrained model's near-uniform softmax)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, d, v = 2048, 1024, 151936
    h = torch.randn(2, n // 2, d, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, d, device="cuda", generator=g) * d**-0.5).bfloat16()
    labels = torch.randint(0, v, (2, n // 2), device="cuda", generator=g)
    labels[0, :100] = IGNORE_INDEX
    out = []
    for fn in (kernel_loss_head(impl), lambda h, w, y: cross_entropy_sum(h @ w.T, y)):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(hh, ww, labels)
        loss.backward()
        out.append((loss.detach(), hh.grad.float(), ww.grad.float()))
    return out


# Largest gradient error allowed, as a fraction of the largest plain gradient entry. Liger (and
# the plain loss) round the logits' gradient to bf16 once and accumulate in fp32. cut
# cross-entropy 25.1.1 keeps its default gradient filter and sums the hidden states' gradient
# over ~1,200 vocabulary blocks in bf16: on this near-uniform softmax either one alone loses
# most of the non-target softmax part, all of which is 3.1e-2 of the largest grad_h entry
# (fp32 computation on CPU of data drawn the same way; the filter alone 2.2e-2, bf16 sums alone
# 3.0e-2), hence 5e-2; grad_W sums 16 token blocks and loses 1.2e-3 at most.
GRAD_BOUNDS = {"liger": {"h": 2e-2, "W": 2e-2}, "cce": {"h": 5e-2, "W": 2e-2}}


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["liger", "cce"])
def test_kernel_loss_matches_plain_loss_and_gradients(impl):
    """bf16 inputs: the loss within 1e-3 relative (both accumulate in fp32), the gradients
    within GRAD_BOUNDS; one message with every figure."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if importlib.util.find_spec(loss_module.KERNEL_LOSSES[impl][0]) is None:
        pytest.skip(f"{impl}: package not installed (pip install -e .[{impl}])")
    (loss, gh, gw), (ref, rh, rw) = _kernel_vs_plain(impl)
    figures = {
        "loss": ((loss - ref).abs() / ref.abs()).item(),
        "h": ((gh - rh).abs().max() / rh.abs().max()).item(),
        "W": ((gw - rw).abs().max() / rw.abs().max()).item(),
    }
    bounds = {"loss": 1e-3, **GRAD_BOUNDS[impl]}
    message = (
        f"{impl} ({loss.dtype} loss {loss.item():.6g} vs plain {ref.item():.6g}): "
        + ", ".join(f"{k} {v:.2e} (bound {bounds[k]:g})" for k, v in figures.items())
    )
    assert loss.dtype == torch.float32 and all(v <= bounds[k] for k, v in figures.items()), message


@pytest.mark.gpu
def test_cce_refuses_float32_training_with_a_config_error():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if importlib.util.find_spec("cut_cross_entropy") is None:
        pytest.skip("cce: package not installed (pip install -e .[cce])")
    h = torch.zeros(1, 4, 8, device="cuda", requires_grad=True)
    w, labels = (
        torch.zeros(16, 8, device="cuda"),
        torch.zeros(1, 4, dtype=torch.long, device="cuda"),
    )
    with pytest.raises(ConfigError, match="mixed_precision_param"):
        kernel_loss_head("cce")(h, w, labels)
