"""Predicted vs measured peak memory, per config.

    python scripts/validate_estimator.py --configs "A.toml --x.y v" "B.toml" [--world_size N]

On a machine with CUDA: the estimator's CUDA estimate (`estimate(config)`) against
torch.cuda.max_memory_allocated() of the second of two real training steps, on one GPU or, with
--world_size N, on N GPUs (one NCCL process each; the error is against the largest rank's peak).
Without CUDA: the estimator's CPU estimate (`estimate(config, target="cpu")`) against the same
tracker on real tensors in `--world_size` gloo processes (default 2; rank 0's peak).
Each config is a TOML path followed by optional --section.key value overrides, in one string.
"""

import argparse
import shlex
import sys

import torch

from torchtitan_ablate.config import load_config
from torchtitan_ablate.memory import estimate
from torchtitan_ablate.memory.validate import measure_cpu, measure_cuda

GIB = 1024**3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", required=True)
    parser.add_argument(
        "--world_size", type=int, default=None, help="ranks (default: 1 GPU, or 2 CPU ranks)"
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    world_size = args.world_size or (1 if cuda else 2)
    print(f"measured by: {'cuda max_memory_allocated' if cuda else 'tracker on real gloo ranks'}")
    print(f"{'config':<70}{'predicted GiB':>14}{'measured GiB':>14}{'error':>9}")
    worst = 0.0
    for spec in args.configs:
        toml, *overrides = shlex.split(spec)
        argv = ["--job.config_file", toml, *overrides]
        config = load_config([*argv, "--memory_estimation.world_size", str(world_size)])
        if cuda:
            predicted = estimate(config)["peak_bytes"]
            leftover = torch.cuda.memory_allocated()
            try:
                per_rank = measure_cuda(config, world_size)
                measured = max(per_rank)
                if world_size > 1:
                    print(f"  per rank GiB: {[round(m / GIB, 4) for m in per_rank]}")
            except (torch.OutOfMemoryError, RuntimeError) as e:  # a spawned rank's OOM too
                print(f"{spec:<70}{predicted / GIB:>14.4f}{'failed':>14}  {str(e).splitlines()[0]}")
                worst = float("inf")
                continue
            if leftover:
                print(f"  ({leftover / GIB:.2f} GiB still allocated before this measurement)")
        else:
            predicted = estimate(config, target="cpu")["peak_bytes"]
            measured = measure_cpu(config, world_size)[0][0]
        err = predicted / measured - 1
        worst = max(worst, abs(err))
        print(f"{spec:<70}{predicted / GIB:>14.4f}{measured / GIB:>14.4f}{100 * err:>8.2f}%")
    print(f"worst |error|: {100 * worst:.2f}%")
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
