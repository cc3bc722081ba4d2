"""metrics.comm_profile: where a few steps' wall time goes (collectives, compute, data loading).

A torch.profiler window over steps 3-5 (or the last steps of a shorter run) records every op;
the busy time of each kind is the union of its events' intervals, so overlapping or nested
events count once, and a share is busy time / window wall time:

- collectives: NCCL kernels on the GPU; on CPU (gloo) the c10d / functional-collective ops and
  their waits, which is the time the training thread spends communicating;
- compute: all other GPU kernels; on CPU the aten ops outside collectives and data loading;
- data loading: the data loader's `__next__` (host side);
- other: wall time covered by none of them (Python, launch and host overhead; on the GPU, idle).

On the GPU, collectives and compute overlap (FSDP prefetch), so their shares can add up to more
than 100%. GPU utilisation is NVML's mean over the window when pynvml is importable. All ranks
profile (equal overhead); rank 0 writes <dump_folder>/comm_profile.json and one log line. The
window's steps are slower than the others by the profiler's overhead.
"""

import json
import logging
import os
import time
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from torchtitan_ablate.config.job_config import Metrics as MetricsConfig

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


def time_shares(events: list, wall_us: float, on_gpu: bool) -> dict[str, Any]:
    """Busy-time shares of collectives, compute and data loading in a profiled window."""
    comm, compute, data, per_comm = [], [], [], {}
    for e in events:
        interval = (e.time_range.start, e.time_range.end)
        on_device = e.device_type != DeviceType.CPU
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
    return {
        "collectives_share": busy_us(comm) / wall_us,
        "compute_share": busy_us(compute) / wall_us,
        "data_loading_share": busy_us(data) / wall_us,
        "other_share": max(0.0, 1.0 - busy_us(comm + compute + data) / wall_us),
        "top_collectives_ms": {name[:80]: round(us / 1e3, 3) for name, us in top},
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
    ) -> None:
        self.enabled = config.comm_profile and total_steps >= 2
        if config.comm_profile and not self.enabled:
            logger.warning("metrics.comm_profile has no effect: it needs at least 2 steps")
        self.first = min(3, total_steps)  # steps 1-2 warm up (allocator, compile)
        self.last = min(self.first + 2, total_steps)
        self.path = os.path.join(dump_folder, "comm_profile.json")
        self.device, self.is_writer = device, is_writer
        self.prof: profile | None = None
        self.gpu_util = _GpuUtil(device)
        self.window_last: int | None = None
        self.summary_: dict[str, Any] | None = None

    def step(self, step: int) -> None:
        if not self.enabled or self.window_last is not None:
            return
        self.seen = step
        if self.prof is None and self.first - 1 <= step < self.last:
            self._start(step + 1)
        elif self.prof is not None:
            self.gpu_util.sample()
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
        if self.is_writer:
            s = self.summary_
            util = "" if s["gpu_util_pct"] is None else f", GPU util {s['gpu_util_pct']:.0f}%"
            logger.info(
                f"comm profile steps {first}-{last}: collectives "
                f"{100 * s['collectives_share']:.1f}%, compute {100 * s['compute_share']:.1f}%, "
                f"data loading {100 * s['data_loading_share']:.1f}% of wall time{util}"
            )
            with open(self.path, "w") as f:
                json.dump(s, f, indent=1)

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
