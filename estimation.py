"""Per-GPU peak-memory estimate without a GPU: `python estimation.py --job.config_file X`."""

from torchtitan_ablate.config import run_main
from torchtitan_ablate.memory import estimate_main

if __name__ == "__main__":
    run_main(estimate_main)
