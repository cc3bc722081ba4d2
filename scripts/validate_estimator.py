"""Predicted vs measured peak memory, per config.

    python scripts/validate_estimator.py --configs "A.toml --x.y v" "B.toml" [--world_size N]
        [--out DIR]

On a machine with CUDA: the estimator's CUDA estimate (`estimate(config)`, of the compiled
program where the config compiles) against `active_bytes.all.peak` of the second of two real
training steps (compiled alike), on one GPU or, with --world_size N, on N GPUs (one NCCL process
each; the error is against the largest rank's peak; every rank's figure is printed).
--out DIR also writes the table as markdown to DIR/estimator_validation_wN.md, rewritten after
each row (each row is printed as soon as it is measured).
Without CUDA: the estimator's CPU estimate (`estimate(config, target="cpu")`) against the same
tracker on real tensors in `--world_size` gloo processes (default 2; the busiest rank's peak:
rank 0, or with pipeline parallel the pipeline rank the estimate names; with pipeline parallel
each pipeline rank's prediction is printed too).
Each config is a TOML path followed by optional --section.key value overrides, in one string.
"""

import argparse
import os
import shlex
import sys


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", required=True)
    parser.add_argument(
        "--world_size", type=int, default=None, help="ranks (default: 1 GPU, or 2 CPU ranks)"
    )
    parser.add_argument("--out", default=None, help="write the markdown table here")
    return parser.parse_args(argv)


if __name__ == "__main__":  # --help and a wrong option answer before torch's imports (seconds)
    parse_args(sys.argv[1:])

import torch

from torchtitan_ablate.config import load_config
from torchtitan_ablate.estimator import estimate
from torchtitan_ablate.estimator.measure import measure_cpu, measure_cuda
from torchtitan_ablate.library_warnings import filter_library_warnings

GIB = 1024**3


def main() -> int:
    args = parse_args(sys.argv[1:])
    cuda = torch.cuda.is_available()
    world_size = args.world_size or (1 if cuda else 2)
    print(f"measured by: {'cuda active_bytes.all.peak' if cuda else 'tracker on real gloo ranks'}")
    print(f"{'config':<70}{'predicted GiB':>14}{'measured GiB':>14}{'error':>9}")
    worst = 0.0
    rows = [
        "| config | compiled | predicted GiB | measured GiB per rank | error |",
        "|---|---|---|---|---|",
    ]
    for spec in args.configs:
        toml, *overrides = shlex.split(spec)
        argv = ["--job.config_file", toml, *overrides]
        config = load_config([*argv, "--memory_estimation.world_size", str(world_size)])
        compiled = "yes" if config.compile.enable else "no"
        if cuda:
            est = estimate(config)
            predicted = est["peak_bytes"]
            _print_pipeline_ranks(est)
            leftover = torch.cuda.memory_allocated()
            try:
                per_rank = measure_cuda(config, world_size)
                measured = max(per_rank)
                if world_size > 1:
                    print(f"  per rank GiB: {[round(m / GIB, 4) for m in per_rank]}", flush=True)
            except (torch.OutOfMemoryError, RuntimeError) as e:  # a spawned rank's OOM too
                why = str(e).splitlines()[0]
                print(f"{spec:<70}{predicted / GIB:>14.4f}{'failed':>14}  {why}", flush=True)
                worst = float("inf")
                rows.append(f"| `{spec}` | {compiled} | {predicted / GIB:.4f} | failed: {why} | |")
                continue
            if leftover:
                print(f"  ({leftover / GIB:.2f} GiB still allocated before this measurement)")
        else:
            est = estimate(config, target="cpu")
            predicted = est["peak_bytes"]
            _print_pipeline_ranks(est)
            per_rank = [peak for peak, _ in measure_cpu(config, world_size)]
            measured = per_rank[est["rank"]]  # the busiest rank's: rank 0, or a pipeline rank
        err = predicted / measured - 1
        worst = max(worst, abs(err))
        ranks = ", ".join(f"{m / GIB:.4f}" for m in per_rank)
        rows.append(
            f"| `{spec}` | {compiled} | {predicted / GIB:.4f} | {ranks} | {100 * err:+.2f}% |"
        )
        line = f"{spec:<70}{predicted / GIB:>14.4f}{measured / GIB:>14.4f}{100 * err:>8.2f}%"
        print(line, flush=True)
        if args.out:  # after every row: a run cut off by its time slot keeps what it measured
            _write_table(args.out, world_size, rows, worst)
    print(f"worst |error|: {100 * worst:.2f}%")
    print("\n".join(rows))
    if args.out:
        print(f"wrote {_write_table(args.out, world_size, rows, worst)}")
    return 0 if worst <= 0.05 else 1


def _print_pipeline_ranks(est: dict) -> None:
    if len(est["ranks"]) > 1:
        by_rank = {r["rank"]: round(r["peak_gib"], 4) for r in est["ranks"]}
        print(f"  predicted GiB per pipeline rank (global rank: GiB): {by_rank}", flush=True)


def _write_table(out: str, world_size: int, rows: list[str], worst: float) -> str:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"estimator_validation_w{world_size}.md")
    with open(path, "w") as f:
        f.write("\n".join(rows) + f"\n\nworst |error|: {100 * worst:.2f}%\n")
    return path


if __name__ == "__main__":
    filter_library_warnings()
    sys.exit(main())
