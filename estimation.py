"""Per-GPU peak-memory estimate without a GPU: `python estimation.py --job.config_file X`
[--memory_estimation.world_size N] [--memory_estimation.device_memory_gib G]
[--memory_estimation.output estimate.json] [--memory_estimation.fewest_gpus true]
[any --section.key value].

The same as the installed command `ttablate-estimate` (torchtitan_ablate/cli.py)."""

from torchtitan_ablate.cli import estimate

if __name__ == "__main__":
    estimate()
