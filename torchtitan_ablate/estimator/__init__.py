"""Memory estimation without a GPU (estimation.py; docs/memory_estimation.md).

`estimate(config)` returns rank 0's peak memory of one training step by category, computed by
running the trainer's own build path and train_step under a fake process group and fake tensors.
`estimate_main(config)` prints the table and verdict and writes the JSON when asked.
"""

import logging
import os

from torchtitan_ablate.config import JobConfig
from torchtitan_ablate.estimator.estimate import estimate
from torchtitan_ablate.estimator.verdict import (
    apply_overrides,
    candidate_knobs,
    device_memory_gib,
    format_report,
    required_gib,
    verdict,
    write_json,
)

__all__ = ["estimate", "estimate_main"]
logger = logging.getLogger("torchtitan_ablate")
VERIFY_BUDGET_S = 20.0  # re-estimate suggestions while the first estimate was this cheap


def estimate_main(config: JobConfig) -> dict:
    if int(os.environ.get("RANK", 0)) != 0:
        return {}  # under torchrun only rank 0 estimates (it models rank 0 of the world)
    logging.getLogger("torchtitan_ablate").setLevel(logging.WARNING)
    est = estimate(config)
    device_gib = device_memory_gib(config)
    fits, line = verdict(est, device_gib)
    tried: list[tuple[str, float | None]] = []
    if not fits:
        for desc, overrides in candidate_knobs(config, est["world_size"]):
            gib = None
            if est["seconds"] < VERIFY_BUDGET_S:
                alt = apply_overrides(config, overrides)
                try:
                    gib = required_gib(estimate(alt))
                except ValueError:
                    continue  # e.g. the knob makes the layout invalid
                if gib >= required_gib(est):
                    continue  # e.g. one more rank adds NCCL's context and shards nothing
            tried.append((desc, gib))
            if len(tried) == 3:
                break
    print(format_report(est, device_gib, fits, line, tried))
    if config.memory_estimation.output:
        write_json(config.memory_estimation.output, est, device_gib, fits, tried)
    return est
