"""The stand-ins for the liger / cce loss kernels (estimator/kernel_loss.py): their allocations
against the packages' (liger-kernel 0.8.5, cut-cross-entropy 25.1.1), and the estimate of both
loss_impls with neither package nor CUDA present."""

import importlib.util

import pytest
import torch

from torchtitan_ablate.components.objective import loss as loss_module
from torchtitan_ablate.config import ConfigError, load_config
from torchtitan_ablate.estimator import estimate
from torchtitan_ablate.estimator.kernel_loss import cce_sum, liger_chunk_size, liger_sum
from torchtitan_ablate.estimator.tracker import MemoryTracker

GIB = 1024**3
SCALARS = 64  # bytes: the loss and the reductions' 0-d results, alive for a few ops


@pytest.mark.parametrize(
    "n, d, v, chunk",
    [
        (16384, 1024, 151936, 128),  # Qwen3-0.6B, batch 4 x 4096: inc_factor 149 -> 110 -> 128
        (8192, 2048, 151936, 128),  # 1.7B, batch 2: inc_factor 75 -> 110 -> 128
        (300, 64, 1000, 32),  # inc_factor 16 -> 19 -> 32
        (300, 64, 50, 300),  # V < D: one chunk, never longer than N
    ],
)
def test_liger_chunk_size_is_its_formula(n, d, v, chunk):
    assert liger_chunk_size(n, d, v) == chunk


def _inputs(n: int, d: int, v: int) -> tuple:
    h = torch.zeros(n, d, dtype=torch.bfloat16, requires_grad=True)
    w = torch.zeros(v, d, dtype=torch.bfloat16, requires_grad=True)
    return h, w, torch.zeros(n, dtype=torch.long)


def _tracked(fn, *args) -> tuple[MemoryTracker, object]:
    """The tracker after fn(*args); entered again, it goes on from what is then alive."""
    with MemoryTracker() as tracker:
        out = fn(*args)
    return tracker, out


@pytest.mark.parametrize("n, d, v", [(300, 64, 1000), (300, 16, 4000)])
def test_liger_forward_holds_both_gradients_and_one_chunk(n, d, v):
    h, w, labels = _inputs(n, d, v)
    tracker, loss = _tracked(liger_sum, h, w, labels)
    grad_h, grad_w32, grad_w16 = n * d * 2, v * d * 4, v * d * 2
    logits = liger_chunk_size(n, d, v) * v * 2
    # Resident through the loop: grad_h, the fp32 grad_w, the per-token losses [N] fp32 and
    # the valid mask [N]; on top, the chunk's logits, then (logits freed) grad_w's bf16 cast.
    resident = grad_h + grad_w32 + n * 4 + n
    expected = resident + max(logits, grad_w16)
    assert expected <= tracker.peak <= expected + SCALARS, (tracker.peak, expected)
    # Saved for backward: the two gradients in the inputs' dtype, nothing else.
    saved = tracker.total
    assert grad_h + grad_w16 <= saved <= grad_h + grad_w16 + SCALARS
    with tracker:
        dh, dw = torch.autograd.grad(loss * 2, (h, w))
    assert tracker.peak <= saved + SCALARS  # backward scales the saved gradients in place
    assert (dh.shape, dh.dtype, dw.shape, dw.dtype) == (h.shape, h.dtype, w.shape, w.dtype)


def test_liger_frozen_weight_gets_no_weight_gradient():
    n, d, v = 300, 64, 1000
    h, w, labels = _inputs(n, d, v)
    tracker, _ = _tracked(liger_sum, h, w.detach(), labels)
    assert tracker.total <= n * d * 2 + SCALARS  # only grad_h is kept


def test_cce_keeps_the_log_sum_exp_and_makes_bf16_gradients_in_backward():
    n, d, v = 300, 64, 1000
    h, w, labels = _inputs(n, d, v)
    tracker, loss = _tracked(cce_sum, h, w, labels)
    # Saved beyond its inputs: lse [N] fp32 and the vocabulary's mean logit [V] fp32.
    saved = n * 4 + v * 4
    assert saved <= tracker.total <= saved + SCALARS
    saved = tracker.total
    # Forward's peak: those, the target dot products [N] fp32 and the lse locks; before them
    # the valid-token index (int64 [N, 1] and its int32 copy) is freed.
    assert tracker.peak <= saved + n * 4 + 4 * -(-n // 128) + SCALARS
    with tracker:
        dh, dw = torch.autograd.grad(loss, (h, w))
    grads = n * d * 2 + v * d * 2  # bf16 dE and dC: no fp32 accumulator
    n_locks = -(-d // 64)
    locks = 4 * n_locks * (-(-n // n_locks) + -(-v // n_locks))
    order = v * (4 + 8 + 4)  # argsort (its sort's values and int64 indices), int32 copy
    assert saved + grads + locks <= tracker.peak <= saved + grads + locks + order + SCALARS
    assert (dh.dtype, dw.dtype) == (torch.bfloat16, torch.bfloat16)


SMALL = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "64"]
SMALL += ["--training.local_batch_size", "2", "--memory_estimation.world_size", "2"]


@pytest.mark.parametrize("impl", ["liger", "cce"])
def test_estimate_of_a_kernel_loss_needs_neither_package_nor_cuda(impl, monkeypatch):
    module = loss_module.KERNEL_LOSSES[impl][0]
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a)
    )
    est = estimate(load_config([*SMALL, "--training.loss_impl", impl]))
    assert est["peak_gib"] > 0
    output = {m["module"]: m["gib"] for m in est["top_modules"]}.get("output", 0.0) * GIB
    # Saved by the loss head at the end of forward, with FSDP's bf16 unsharded weight [V, D]:
    # liger its two bf16 gradients; cce only the log-sum-exp [N] and the mean logit [V] (fp32),
    # too little to be among the top modules (h and W are the norm's output and the weight).
    n, d, v = 2 * 64, 256, 2048
    if impl == "liger":
        assert output == pytest.approx(n * d * 2 + v * d * 2, abs=2 * 512)
    else:
        assert output <= n * 4 + v * 4 + 2 * 512
    # Training still refuses: the stand-ins are the estimate's only.
    with pytest.raises(ConfigError, match="pip install"):
        loss_module.check_kernel_loss(impl)
