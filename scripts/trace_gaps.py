"""Where a GPU sits idle: the gaps between kernels in a torch.profiler chrome trace.

    python scripts/trace_gaps.py TRACE.json[.gz] [--min-us 50] [--steps 2] [--top 15]

TRACE is what `scripts/bench.py --profile --trace FILE` writes (two steps of rank 0) or one of the
trainer's `profiling.enable_profiling` traces (one step: `--steps 1`). Every gap of at least
--min-us between the end of the GPU's last kernel and the start of the next is charged to the
pair (kernel before, kernel after) and to one of two causes:

    cpu-late    the CPU had not yet launched the next kernel when the GPU ran dry: host-bound
                (Python, a host sync that drained the queue, launch overhead)
    dependency  the next kernel was already launched: it waited for something else (another
                stream's event, a collective's peers, a copy engine)

Kernels of all streams count as busy time, so a gap is time no stream ran anything.
"""

import argparse
import gzip
import json
import sys
from collections import defaultdict

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load_events(path: str) -> list[dict]:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _short(name: str) -> str:
    return name.split("(")[0].removeprefix("void ")[:60]


def idle_gaps(events: list[dict], min_us: float) -> tuple[float, dict[tuple, list[float]]]:
    """(total idle us in gaps >= min_us, {(before, after, cause): [count, us]})."""
    kernels = sorted(
        (e for e in events if e.get("cat") in GPU_CATEGORIES and "dur" in e),
        key=lambda e: e["ts"],
    )
    launched_at = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    pairs: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0])
    total = 0.0
    if not kernels:
        return total, pairs
    busy_until, last = kernels[0]["ts"] + kernels[0]["dur"], kernels[0]
    for k in kernels[1:]:
        gap = k["ts"] - busy_until
        if gap >= min_us:
            launch = launched_at.get(k.get("args", {}).get("correlation"))
            cause = "cpu-late" if launch is not None and launch > busy_until else "dependency"
            entry = pairs[(_short(last["name"]), _short(k["name"]), cause)]
            entry[0] += 1
            entry[1] += gap
            total += gap
        if k["ts"] + k["dur"] > busy_until:
            busy_until, last = k["ts"] + k["dur"], k
    return total, pairs


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--min-us", type=float, default=50.0, help="smallest gap counted (us)")
    p.add_argument("--steps", type=int, default=2, help="steps in the trace (per-step figures)")
    p.add_argument("--top", type=int, default=15, help="rows of the table")
    args = p.parse_args(argv)
    try:
        events = load_events(args.trace)
    except (OSError, ValueError, KeyError) as e:
        print(f"trace_gaps: cannot read {args.trace} as a chrome trace: {e}", file=sys.stderr)
        return 2
    total, pairs = idle_gaps(events, args.min_us)
    n = max(args.steps, 1)
    print(f"GPU idle in gaps >= {args.min_us:g} us: {total / 1e3 / n:.2f} ms per step")
    print("| kernel before | kernel after | cause | gaps per step | ms per step |")
    print("|---|---|---|---|---|")
    for (before, after, cause), (count, us) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[
        : args.top
    ]:
        print(f"| {before} | {after} | {cause} | {count / n:g} | {us / 1e3 / n:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
