"""What to change when the estimate does not fit: only changes that can work.

When the model-state floor (floor.py: parameters, gradients and optimizer states) and the CUDA
context alone exceed the card, no batch size or activation checkpointing can help: the verdict
says so and names the fewest GPUs whose share of the model state fits. Otherwise single knobs
(verdict.candidate_knobs) are re-estimated, cheapest first, while the first estimate was cheap.
"""

from torchtitan_ablate.config import JobConfig
from torchtitan_ablate.estimator.cuda_model import context_gib
from torchtitan_ablate.estimator.estimate import estimate
from torchtitan_ablate.estimator.floor import StateFloor, model_state
from torchtitan_ablate.estimator.verdict import (
    apply_overrides,
    candidate_knobs,
    required_gib,
    verdict,
)
from torchtitan_ablate.estimator.world_sizes import fewest_by_floor, floor_at, floor_fits

VERIFY_BUDGET_S = 20.0  # re-estimate suggestions while the first estimate was this cheap


def advise(
    config: JobConfig, est: dict, device_gib: float
) -> tuple[bool, str, list[tuple[str, float | None]], StateFloor]:
    """(fits, verdict line, [(change, re-estimated GiB or None)], the model-state floor)."""
    params = model_state(config)
    floor = floor_at(config, params, est["world_size"])
    fits, line = verdict(est, device_gib)
    if fits:
        return True, line, [], floor
    if not floor_fits(floor, device_gib):
        line += (
            f"; parameters, gradients and optimizer states alone take {floor.describe()}, "
            f"with {context_gib(floor.world_size):.1f} GiB of CUDA context: no batch size or "
            "activation checkpointing removes them"
        )
        n = fewest_by_floor(config, params, device_gib, 2 * est["world_size"])
        if n is None:
            return False, line, [], floor
        more = f"--memory_estimation.world_size {n} (the fewest GPUs whose share of them fits)"
        return False, line, [(more, None)], floor
    tried: list[tuple[str, float | None]] = []
    for desc, overrides in candidate_knobs(config, est["world_size"]):
        gib = None
        if est["seconds"] < VERIFY_BUDGET_S:
            try:
                gib = required_gib(estimate(apply_overrides(config, overrides)))
            except ValueError:
                continue  # e.g. the knob makes the layout invalid
            if gib >= required_gib(est):
                continue  # e.g. one more rank adds NCCL's context and shards nothing
        tried.append((desc, gib))
        if len(tried) == 3:
            break
    if not tried:
        line += (
            "; no single change tried lowers it (activation checkpointing, smaller "
            "micro-batches, more GPUs): weights, optimizer states and the CUDA context remain"
        )
    return False, line, tried, floor
