"""Memory estimation without a GPU (estimation.py; docs/memory_estimation.md).

`estimate(config)` returns rank 0's peak memory of one training step by category, computed by
running the trainer's own build path and train_step under a fake process group and fake tensors.
`estimate_main(config)` prints the table and verdict (advice.py: what to change when it does not
fit) and writes the JSON when asked; with memory_estimation.fewest_gpus it searches the fewest
GPUs that fit and the fastest layout there instead (fewest_gpus.py).
"""

import logging
import os

from torchtitan_ablate.config import JobConfig
from torchtitan_ablate.estimator.advice import advise
from torchtitan_ablate.estimator.estimate import estimate
from torchtitan_ablate.estimator.fewest_gpus import fewest_gpus, format_search, search_json
from torchtitan_ablate.estimator.verdict import device_memory_gib, format_report, write_json

__all__ = ["estimate", "estimate_main"]
logger = logging.getLogger("torchtitan_ablate")


def estimate_main(config: JobConfig) -> dict:
    if int(os.environ.get("RANK", 0)) != 0:
        return {}  # under torchrun only rank 0 estimates (it models rank 0 of the world)
    logging.getLogger("torchtitan_ablate").setLevel(logging.WARNING)
    device_gib = device_memory_gib(config)
    output = config.memory_estimation.output
    if config.memory_estimation.fewest_gpus:
        search = fewest_gpus(config, device_gib, log=lambda line: print(line, flush=True))
        print(format_search(search, config, device_gib))
        if output:
            doc = {"fits": search.answer is not None}
            doc["fewest_gpus"] = search_json(search, config, device_gib)
            write_json(output, search.answer.est if search.answer else None, device_gib, doc)
        return search.answer.est if search.answer else {}
    est = estimate(config)
    fits, line, tried, floor = advise(config, est, device_gib)
    print(format_report(est, device_gib, fits, line, tried))
    if output:
        doc = {"fits": fits, "suggestions": [{"change": d, "peak_gib": g} for d, g in tried]}
        doc["model_state_floor_gib"] = floor.total_gib
        write_json(output, est, device_gib, doc)
    return est
