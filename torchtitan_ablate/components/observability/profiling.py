"""profiling.enable_profiling: a torch.profiler trace of one step every `profile_freq` steps,
written as <dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json (open it in
Perfetto or chrome://tracing)."""

import logging
import os
import traceback
import warnings
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from torchtitan_ablate.config.job_config import Profiling as ProfilingConfig

logger = logging.getLogger("torchtitan_ablate")


class TraceProfiler:
    """`.step(step)` after every train step, `.close()` at the end; a no-op when disabled."""

    def __init__(
        self, config: ProfilingConfig, dump_folder: str, rank: int, device: torch.device
    ) -> None:
        self.enabled = config.enable_profiling
        self.current_step = 0
        if not self.enabled:
            return
        self.folder = os.path.join(dump_folder, config.save_traces_folder)
        self.rank = rank
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        # One warm-up step (profiler start-up cost stays out of the trace), then one traced step.
        warmup, active = 1, 1
        self.prof = profile(
            activities=activities,
            schedule=schedule(
                wait=config.profile_freq - warmup - active, warmup=warmup, active=active
            ),
            on_trace_ready=self._write,
            record_shapes=True,
        )
        self.prof.__enter__()

    def _write(self, prof: profile) -> None:
        folder = os.path.join(self.folder, f"iteration_{self.current_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_trace.json")
        prof.export_chrome_trace(path)
        if self.rank == 0:
            logger.info(f"profiler trace of step {self.current_step}: {path}")

    def step(self, step: int) -> None:
        if self.enabled:
            self.current_step = step
            self.prof.step()

    def close(self) -> None:
        if self.enabled:
            self.prof.__exit__(None, None, None)
            self.enabled = False


def print_sync_sites(step_fn: Callable, batch) -> None:
    """One step under CUDA's sync debug mode: where each host sync comes from (the Python
    frames that made it, innermost last), with counts."""
    sites: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        frames = traceback.extract_stack()[:-1]
        frames = [f for f in frames if "warnings" not in f.filename][-5:]
        key = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames))
        sites[key] = sites.get(key, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step_fn(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for key, n in sorted(sites.items(), key=lambda kv: -kv[1]):
        print(f"sync x{n}: {key}")
