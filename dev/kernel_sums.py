"""Measuring tool only: GPU time by kernel name in a profiler trace (a profiled step of
--profiling.enable_profiling), the busiest first, with the trace's kernel count and span:

    python3 dev/kernel_sums.py TRACE.json[.gz] [TOP]
"""

import gzip
import json
import sys
from collections import defaultdict


def main(path: str, top: int = 30) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    kernels = [e for e in events if e.get("cat") in kinds and "dur" in e]
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        name = e["name"].split("(")[0].removeprefix("void ")[:70]
        by_name[name][0] += 1
        by_name[name][1] += e["dur"]
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    busy = sum(d for _, d in by_name.values())
    print(f"{path}: {len(kernels)} kernels, busy {busy / 1e3:.1f} ms, span {span / 1e3:.1f} ms")
    for name, (count, dur) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {dur / 1e3:8.2f} ms {count:6d}  {name}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30)
