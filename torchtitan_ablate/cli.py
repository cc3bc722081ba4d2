"""Console commands of an installed package (pyproject.toml [project.scripts]).

    ttablate-train     = python -m torchtitan_ablate.train        (one process; torchrun for more)
    ttablate-estimate  = python estimation.py                      (per-GPU peak memory, no GPU)
    ttablate-ablate    = python scripts/ablate.py                  (torchtitan_ablate/ablate/cli.py)

Both commands here take `--job.config_file X [--section.key value ...]`. Relative paths inside
the TOML are found from the TOML's folder; those on the command line and job.dump_folder are
relative to the current directory (config/paths.py).
"""

import runpy
import sys


def train() -> None:
    """`python -m torchtitan_ablate.train`, run as that module's __main__ so the command and the
    module can never drift apart (argument handling, exit codes)."""
    runpy.run_module("torchtitan_ablate.train", run_name="__main__", alter_sys=True)


def estimate(argv: list[str] | None = None) -> None:
    """Per-GPU peak-memory estimate without a GPU: `ttablate-estimate --job.config_file X`
    [--memory_estimation.world_size N] [--memory_estimation.device_memory_gib G]
    [--memory_estimation.output estimate.json] [--memory_estimation.fewest_gpus true]
    [any --section.key value]."""
    from torchtitan_ablate.config.precheck import check_before_torch

    check_before_torch(sys.argv[1:] if argv is None else argv, "python estimation.py", False)
    from torchtitan_ablate.config import run_main  # after the check: the estimator imports torch
    from torchtitan_ablate.estimator import estimate_main

    run_main(estimate_main, argv)
