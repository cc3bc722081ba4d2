"""The comparison of a float8 run in another layout with the one-process float8 run: float8
rounding lets the runs agree only to its own precision (tolerances in each test's docstring)."""

import math

import torch


def rel_l2(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Relative L2 distance between two sets of parameters with the same names."""
    diff = sum(((got[k] - ref[k]) ** 2).sum().item() for k in ref)
    return math.sqrt(diff / sum((v**2).sum().item() for v in ref.values()))


def assert_float8_trains_like(
    got: dict, ref: dict, loss1: float, weights: float, norm1: float = 1e-4, later: float = 5e-4
) -> None:
    """train_layout figures of 3 steps: the step-1 loss and gradient norm (same weights) within
    loss1 / norm1 relative, the later losses within `later`, the final weights within
    `weights` relative L2 distance."""
    assert len(got["losses"]) == len(ref["losses"]) == 3
    (got1, *got_later), (ref1, *ref_later) = got["losses"], ref["losses"]
    assert abs(got1 - ref1) <= loss1 * ref1, f"step 1: loss {got1} vs {ref1}"
    got_norm, ref_norm = got["grad_norms"][0], ref["grad_norms"][0]
    assert abs(got_norm - ref_norm) <= norm1 * ref_norm, (
        f"step 1: grad norm {got_norm} vs {ref_norm}"
    )
    for step, (a, b) in enumerate(zip(got_later, ref_later, strict=True), 2):
        assert abs(a - b) <= later * b, f"step {step}: loss {a} vs {b}"
    assert got["params"].keys() == ref["params"].keys()
    assert rel_l2(got["params"], ref["params"]) <= weights
