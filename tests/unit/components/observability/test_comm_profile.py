"""metrics.comm_profile: interval arithmetic, and a real profiler window on one CPU process."""

import json
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from torchtitan_ablate.components.observability.comm_profile import (
    CommProfiler,
    busy_us,
    pipeline_entry,
    time_shares,
)
from torchtitan_ablate.config.job_config import Metrics


def test_busy_us_is_the_union():
    assert busy_us([]) == 0
    assert busy_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25


def event(name, start, end, parent=None, device=DeviceType.CPU):
    rng = SimpleNamespace(start=start, end=end)
    return SimpleNamespace(name=name, time_range=rng, cpu_parent=parent, device_type=device)


def test_time_shares_cpu():
    comm = event("c10d::allreduce_", 0, 30)
    events = [
        comm,
        event("aten::copy_", 5, 10, parent=comm),  # inside a collective: not compute
        event("gloo:all_reduce", 20, 40),
        event("aten::mm", 40, 80),
        event("enumerate(DataLoader)#StatefulDataLoader.__next__", 80, 90),
    ]
    s = time_shares(events, 100.0, on_gpu=False)
    assert (s["collectives_share"], s["compute_share"], s["data_loading_share"]) == (0.4, 0.4, 0.1)
    assert abs(s["other_share"] - 0.1) < 1e-12


def test_time_shares_gpu_counts_kernels():
    events = [
        event("ncclDevKernel_AllGather_RING_LL", 0, 50, device=DeviceType.CUDA),
        event("sm90_gemm", 20, 70, device=DeviceType.CUDA),
        event("c10d::allgather_", 0, 100),  # host side of the collective: not counted on GPU
    ]
    s = time_shares(events, 100.0, on_gpu=True)
    assert (s["collectives_share"], s["compute_share"]) == (0.5, 0.5)


def test_profiler_window_on_cpu(tmp_path):
    config = Metrics(comm_profile=True)
    prof = CommProfiler(config, str(tmp_path), torch.device("cpu"), True, total_steps=6)
    x = torch.randn(64, 64)
    for step in range(1, 7):
        (x @ x).sum()
        prof.step(step)
    assert prof.summary() is None  # read at close, off the measured steps
    prof.close()
    s = json.loads((tmp_path / "comm_profile.json").read_text())
    assert s["steps"] == [3, 5] and s["collectives_share"] == 0.0
    assert 0 < s["compute_share"] <= 1 and s["gpu_util_pct"] is None
    assert "pipeline" not in s  # without pipeline parallel: no gather, no entry


def test_off_by_default(tmp_path):
    prof = CommProfiler(Metrics(), str(tmp_path), torch.device("cpu"), True, total_steps=6)
    for step in range(1, 7):
        prof.step(step)
    prof.close()
    assert prof.summary() is None and not (tmp_path / "comm_profile.json").exists()


def test_pipeline_entry_averages_the_ranks_of_each_pipeline_rank():
    layout = {"schedule": "1F1B", "degree": 2, "theoretical_bubble": 0.2}
    ranks = [  # PP 2 x DP 2, world order: pp rank 0 on ranks 0, 1
        {"pp_rank": 0, "compute_share": 0.7, "peak_active_gib": 3.0},
        {"pp_rank": 0, "compute_share": 0.5, "peak_active_gib": 4.0},
        {"pp_rank": 1, "compute_share": 0.9, "peak_active_gib": None},
        {"pp_rank": 1, "compute_share": 1.05, "peak_active_gib": None},  # clipped: bubble 0
    ]
    e = pipeline_entry(layout, ranks)
    assert e["schedule"] == "1F1B" and e["theoretical_bubble"] == 0.2
    (first, second) = e["per_pp_rank"]
    assert (first["pp_rank"], first["ranks"], first["peak_active_gib"]) == (0, 2, 4.0)
    assert first["measured_bubble"] == pytest.approx(0.4)  # mean of 0.3 and 0.5
    assert second["measured_bubble"] == pytest.approx(0.05) and second["peak_active_gib"] is None
    assert e["measured_bubble_mean"] == pytest.approx(0.225)
    assert e["measured_bubble_max"] == pytest.approx(0.4)
