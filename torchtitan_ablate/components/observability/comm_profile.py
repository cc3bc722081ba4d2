"""metrics.comm_profile: where a few steady-state steps' wall time goes.

A torch.profiler window over the 3 steps after training.throughput_warmup_steps (or the last
steps of a shorter run) records every op; the busy time of each kind is the union of its events'
intervals, so overlapping or nested events count once, and a share is busy time / window wall
time:

- collectives: NCCL kernels on the GPU; on CPU (gloo) the c10d / functional-collective ops and
  their waits, which is the time the training thread spends communicating;
- compute: all other GPU kernels (GPU-side annotations such as Optimizer.step#... or FSDP::...
  span kernels and are not kernels); on CPU the aten ops outside collectives and data loading;
- exposed collectives: collective time no compute overlaps (busy(collectives + compute) -
  busy(compute)), what the step would save without communication;
- idle: wall time with neither (on the GPU: GPU idle, host-bound; on CPU: Python and other host
  work outside ops, data loading included);
- data loading: the data loader's `__next__` (host side; while it runs, the GPU idles once its
  queue has drained).

compute + exposed collectives + idle = 100%. On the GPU, collectives and compute overlap (FSDP
prefetch), so collectives + compute can exceed 100%. GPU utilisation is NVML's mean over the
window when pynvml is importable. All ranks profile (equal overhead); rank 0 writes
<dump_folder>/comm_profile.json and one log line, its own shares.

Under pipeline parallel the ranks' shares are gathered to rank 0 at close, and the file gains a
"pipeline" entry: the schedule's shape and theoretical bubble (pipeline_parallel.py's
theoretical_bubble), and per pipeline rank the measured bubble, 1 - compute share: the share of
the window in which that rank's device runs no compute (on the GPU: P2P waits, exposed FSDP
collectives and host-bound idle alike; on CPU also Python between ops), averaged over the ranks
of that pipeline rank, then their mean and max; on CUDA each pipeline rank's peak active memory
over the window's steps (the allocator's peak since the metrics logger's last reset, which
log_freq = 1 makes the window's). The window's steps are slower than the others
by the profiler's overhead: the trainer marks their metrics.jsonl records "profiled" and the
steady-state figures leave them out. scripts/bench.py --profile uses the same interval analysis.
"""

import json
import logging
import os
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from torchtitan_ablate.config.job_config import Metrics as MetricsConfig

if TYPE_CHECKING:
    from torchtitan_ablate.distributed.pipeline_parallel import Pipeline

logger = logging.getLogger("torchtitan_ablate")

COMM_MARKERS = ("nccl", "c10d::", "_c10d_functional", "gloo:", "record_param_comms")


def is_collective(name: str) -> bool:
    lower = name.lower()
    return any(m in lower for m in COMM_MARKERS)


def is_data_loading(name: str) -> bool:
    return "DataLoader" in name and "__next__" in name


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _inside(event: Any, predicate) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if predicate(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def exposed_and_idle(
    comm: list[tuple[float, float]], compute: list[tuple[float, float]], window_us: float
) -> dict[str, float]:
    """Busy, exposed-collective and idle microseconds of a window from the collective and
    compute intervals: exposed = busy(comm + compute) - busy(compute)."""
    busy = busy_us(comm + compute)
    return {"busy_us": busy, "exposed_us": busy - busy_us(compute), "idle_us": window_us - busy}


def is_gpu_kernel(event: Any) -> bool:
    """A kernel (or memcpy/memset) on the GPU; GPU-side user annotations span kernels."""
    return event.device_type == DeviceType.CUDA and not getattr(event, "is_user_annotation", False)


def time_shares(events: list, wall_us: float, on_gpu: bool) -> dict[str, Any]:
    """Busy-time shares of collectives, compute, data loading, exposed collectives and idle in a
    profiled window."""
    comm, compute, data, per_comm = [], [], [], {}
    for e in events:
        interval = (e.time_range.start, e.time_range.end)
        on_device = e.device_type != DeviceType.CPU
        if on_device and not is_gpu_kernel(e):
            continue
        if not on_device and is_data_loading(e.name):
            data.append(interval)
        elif is_collective(e.name) and on_device == on_gpu:
            comm.append(interval)
            per_comm[e.name] = per_comm.get(e.name, 0.0) + interval[1] - interval[0]
        elif on_gpu and on_device:
            compute.append(interval)
        elif not on_gpu and e.name.startswith("aten::"):
            if not _inside(e, lambda n: is_collective(n) or is_data_loading(n)):
                compute.append(interval)
    top = sorted(per_comm.items(), key=lambda kv: -kv[1])[:5]
    split = exposed_and_idle(comm, compute, wall_us)
    return {
        "collectives_share": busy_us(comm) / wall_us,
        "compute_share": busy_us(compute) / wall_us,
        "exposed_collectives_share": split["exposed_us"] / wall_us,
        "idle_share": max(0.0, split["idle_us"] / wall_us),
        "data_loading_share": busy_us(data) / wall_us,
        "other_share": max(0.0, 1.0 - busy_us(comm + compute + data) / wall_us),
        "top_collectives_ms": {name[:80]: round(us / 1e3, 3) for name, us in top},
    }


def pipeline_entry(layout: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """comm_profile.json's "pipeline" entry from the schedule's layout (Pipeline.layout) and every
    rank's {"pp_rank", "compute_share", "peak_active_gib"}: per pipeline rank the measured
    bubble (1 - compute share, averaged over its ranks) and peak (max), then the bubbles' mean
    and max over the pipeline ranks."""
    by_pp: dict[int, list[dict]] = {}
    for r in ranks:
        by_pp.setdefault(r["pp_rank"], []).append(r)
    stages = []
    for pp_rank, group in sorted(by_pp.items()):
        bubble = statistics.fmean(min(1.0, max(0.0, 1 - r["compute_share"])) for r in group)
        peaks = [r["peak_active_gib"] for r in group if r["peak_active_gib"] is not None]
        stages.append({"pp_rank": pp_rank, "ranks": len(group), "measured_bubble": bubble,
                       "peak_active_gib": max(peaks) if peaks else None})  # fmt: skip
    measured = [st["measured_bubble"] for st in stages]
    return layout | {
        "measured_bubble_mean": statistics.fmean(measured),
        "measured_bubble_max": max(measured),
        "per_pp_rank": stages,
    }


class _GpuUtil:
    """NVML utilisation samples of this process's GPU; inactive without pynvml or a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.handle, self.samples = None, []
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            props = torch.cuda.get_device_properties(device)
            bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
            self.handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus)
            self.nvml = pynvml
        except Exception:  # no NVML: utilisation is omitted
            self.handle = None

    def sample(self) -> None:
        if self.handle is not None:
            self.samples.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)

    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


class CommProfiler:
    """`.step(step)` after every train step profiles steps first..last once; `.close()` at the
    end of training reads the events and writes the shares. A no-op unless
    metrics.comm_profile is set."""

    def __init__(
        self,
        config: MetricsConfig,
        dump_folder: str,
        device: torch.device,
        is_writer: bool,
        total_steps: int,
        warmup_steps: int = 2,
        pipeline: "Pipeline | None" = None,
        pp_rank: int = 0,
    ) -> None:
        """warmup_steps: steps before the window (allocator, compile); a shorter run profiles
        its last steps. pipeline (this rank's, under pipeline parallel) and pp_rank: the shares
        of all ranks are gathered at close into the "pipeline" entry; every rank calls close()."""
        self.enabled = config.comm_profile and total_steps >= 2
        if config.comm_profile and not self.enabled:
            logger.warning("metrics.comm_profile has no effect: it needs at least 2 steps")
        self.first = max(min(warmup_steps + 1, total_steps - 2), 2)
        self.last = min(self.first + 2, total_steps)
        self.window_first: int | None = None
        self.path = os.path.join(dump_folder, "comm_profile.json")
        self.device, self.is_writer = device, is_writer
        self.prof: profile | None = None
        self.gpu_util = _GpuUtil(device)
        self.window_last: int | None = None
        self.summary_: dict[str, Any] | None = None
        self.layout = pipeline.layout() if pipeline is not None else None
        self.pp_rank, self.peak_active = pp_rank, 0

    def covers(self, step: int) -> bool:
        """Whether the profiler recorded this step (call after step(step))."""
        if self.window_first is None or step < self.window_first:
            return False
        return self.window_last is None or step <= self.window_last

    def step(self, step: int) -> None:
        if not self.enabled or self.window_last is not None:
            return
        self.seen = step
        if self.prof is None and self.first - 1 <= step < self.last:
            self._start(step + 1)
        elif self.prof is not None:
            self.gpu_util.sample()
            if self.layout is not None and self.device.type == "cuda":
                peak = torch.cuda.memory_stats(self.device).get("active_bytes.all.peak", 0)
                self.peak_active = max(self.peak_active, peak)
            if step >= self.last:
                self._stop(step)

    def _start(self, first_step: int) -> None:
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        self.window_first = first_step
        self.prof = profile(activities=activities)
        self.prof.start()
        self.t0 = time.perf_counter()

    def _stop(self, last_step: int) -> None:
        """Ends the window; the events are read in close(), off the measured steps."""
        assert self.prof is not None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.wall_us = (time.perf_counter() - self.t0) * 1e6
        self.prof.stop()
        self.window_last = last_step

    def _summarize(self) -> None:
        assert self.prof is not None
        on_gpu = self.device.type == "cuda"
        first, last = self.window_first, self.window_last
        self.summary_ = {
            "steps": [first, last],
            "wall_ms_per_step": self.wall_us / 1e3 / (last - first + 1),
            **time_shares(list(self.prof.events()), self.wall_us, on_gpu),
            "gpu_util_pct": self.gpu_util.mean(),
            "method": "CUDA kernel intervals" if on_gpu else "CPU op intervals",
        }
        self.prof = None
        if self.layout is not None:
            self.summary_["pipeline"] = self._gather_pipeline()
        if self.is_writer:
            s = self.summary_
            util = "" if s["gpu_util_pct"] is None else f", GPU util {s['gpu_util_pct']:.0f}%"
            idle = "GPU idle" if on_gpu else "outside ops"
            logger.info(
                f"comm profile steps {first}-{last}: compute {100 * s['compute_share']:.1f}%, "
                f"exposed collectives {100 * s['exposed_collectives_share']:.1f}% (all "
                f"collectives {100 * s['collectives_share']:.1f}%), {idle} "
                f"{100 * s['idle_share']:.1f}%, data loading "
                f"{100 * s['data_loading_share']:.1f}% of wall time{util}"
            )
            if self.layout is not None:
                pipe, theory = s["pipeline"], s["pipeline"]["theoretical_bubble"]
                logger.info(
                    f"pipeline bubble measured {100 * pipe['measured_bubble_mean']:.1f}% mean, "
                    f"{100 * pipe['measured_bubble_max']:.1f}% max over the pipeline ranks; "
                    + ("no theoretical figure" if theory is None else f"theory {100 * theory:.1f}%")
                )
            with open(self.path, "w") as f:
                json.dump(s, f, indent=1)

    def _gather_pipeline(self) -> dict[str, Any]:
        """The "pipeline" entry from every rank's compute share and peak (a collective over the
        world: object gathers work on gloo and NCCL alike; once per run, off the window)."""
        assert self.layout is not None and self.summary_ is not None
        peak = self.peak_active / 2**30 if self.device.type == "cuda" else None
        mine = {"pp_rank": self.pp_rank, "compute_share": self.summary_["compute_share"]}
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine | {"peak_active_gib": peak})
        return pipeline_entry(self.layout, ranks)

    def summary(self) -> dict[str, Any] | None:
        """The shares once close() has run after the window, else None."""
        return self.summary_

    def close(self) -> None:
        """Ends a window the run stopped inside, then reads the events and writes the shares."""
        if self.prof is None:
            return
        if self.window_last is None:
            self._stop(self.seen)
        self._summarize()
