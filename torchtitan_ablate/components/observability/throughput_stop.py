"""training.throughput_noise_target: stop a run once its steady-state tokens/s is known."""

import logging
import statistics

from torchtitan_ablate.components.observability.metrics import median_noise, steady_values
from torchtitan_ablate.config.job_config import Training

logger = logging.getLogger("torchtitan_ablate")


def throughput_measured(records: list[dict], training: Training, announce: bool) -> bool:
    """Whether the median tokens/s of the logged records after throughput_warmup_steps is
    known within training.throughput_noise_target (metrics.median_noise); announce: log the
    line that says so (rank 0)."""
    target = training.throughput_noise_target
    if target <= 0:
        return False
    tps = steady_values(records, training.throughput_warmup_steps)
    noise = median_noise(tps)
    if noise is None or noise > target:
        return False
    if announce:
        logger.info(
            f"tokens/s median {statistics.median(tps):,.0f} known within +-{100 * noise:.2f}% "
            f"over {len(tps)} steady steps (training.throughput_noise_target = {target})"
        )
    return True
