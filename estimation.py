"""Per-GPU peak-memory estimate without a GPU: `python estimation.py --job.config_file X`
[--memory_estimation.world_size N] [--memory_estimation.device_memory_gib G]
[--memory_estimation.output estimate.json] [any --section.key value]."""

from torchtitan_ablate.config import run_main
from torchtitan_ablate.memory import estimate_main

if __name__ == "__main__":
    run_main(estimate_main)
