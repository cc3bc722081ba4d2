"""The estimate-vs-real-ranks rule shared by the CPU memory checks."""

from torchtitan_ablate.config.job_config import JobConfig
from torchtitan_ablate.estimator.measure import measure_cpu


def assert_estimate_matches_ranks(
    config: JobConfig, predicted: int, every: float, world_size: int = 2, spawns: int = 3
) -> None:
    """gloo frees a collective's buffers when its own thread completes the collective, so a
    rank's real peak can hold a buffer the ordered program has dropped: how often depends on
    thread timing and holds for a whole process (seen: +3.1% eager on a loaded machine; +5.1%
    compiled on both ranks of one clean CI run, on 3 of 20 rank readings locally). The estimate
    is the ordered program: within 2% of the quietest reading, and within `every` of each
    rank's. Where no rank of a spawn reads quiet, the ranks run again (at most `spawns`
    times) and each keeps its smallest reading: a late free only ever raises one."""
    measured = [peak for peak, _ in measure_cpu(config, world_size)]
    for _ in range(spawns - 1):
        if abs(predicted / min(measured) - 1) < 0.02:
            break
        again = [peak for peak, _ in measure_cpu(config, world_size)]
        measured = [min(a, b) for a, b in zip(measured, again)]
    assert abs(predicted / min(measured) - 1) < 0.02, (predicted, measured)
    for peak in measured:
        assert abs(predicted / peak - 1) < every, (predicted, measured)
