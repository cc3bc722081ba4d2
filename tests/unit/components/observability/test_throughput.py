"""The measurement definitions: attention pairs of packed documents, the confidence interval of
the median tokens/s, real vs processed tokens and the two MFU figures in a metrics record, and
the exposed-communication / idle split of a profiled window."""

import json
from types import SimpleNamespace

import torch
from torch.autograd import DeviceType

from torchtitan_ablate.components.observability.comm_profile import (
    CommProfiler,
    exposed_and_idle,
    time_shares,
)
from torchtitan_ablate.components.observability.metrics import (
    MetricsLogger,
    attention_pairs,
    median_noise,
    steady_values,
)
from torchtitan_ablate.config.job_config import Metrics


def test_attention_pairs_are_causal_per_document():
    ids = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]])
    # row 0: documents of 3 and 2 tokens -> 6 + 3; row 1: one of 5 -> 15
    assert attention_pairs(ids, 5, 2) == 6 + 3 + 15
    assert attention_pairs(None, 5, 2) == 2 * 15  # no document ids: one document per row
    # A new row restarts the count even where its first id equals the last row's last id.
    assert attention_pairs(torch.tensor([[0, 1], [1, 1]]), 2, 2) == 1 + 1 + 3


def test_median_noise_is_the_order_statistic_interval():
    assert median_noise([100.0] * 9) is None  # fewer than 10 values
    xs = [100.0] * 8 + [90.0, 120.0]
    assert median_noise(xs) == (120 - 90) / 2 / 100  # n = 10: min to max
    # n = 100: order statistics 40 and 61, so a few slow outlier steps do not widen it.
    ys = [100.0 + 0.01 * i for i in range(96)] + [10.0, 10.0, 500.0, 500.0]
    noise = median_noise(ys)
    assert noise is not None and noise < 0.005
    assert median_noise([0.0] * 12) is None


def test_steady_values_leave_out_warmup_and_profiled_steps():
    rows = [{"step": s, "tps": float(s)} for s in range(1, 7)]
    rows[3]["profiled"] = True  # step 4
    assert steady_values(rows, 2) == [3.0, 5.0, 6.0]


def test_record_has_real_and_processed_tokens_and_both_mfus(tmp_path, monkeypatch):
    from torchtitan_ablate.components.observability import metrics as metrics_mod

    now = [0.0]
    monkeypatch.setattr(metrics_mod.time, "perf_counter", lambda: now[0])
    m = MetricsLogger(
        Metrics(peak_tflops=1.0), str(tmp_path), torch.device("cpu"), 10.0, True,
        dense_flops_per_token=4.0, attention_flops_per_pair=0.5,
    )  # fmt: skip
    m.open(resumed_step=0)
    now[0] = 2.0  # one step of 2 s: 1000 tokens processed, 800 trained, 300 attention pairs
    m.add_tokens(1000, 0.5, attention_pairs=300, profiled=True)
    m.add_trained(800)
    r = m.log(1, {"loss": 1.0, "grad_norm": 1.0, "lr": 1.0})
    assert r["tps"] == 400 and r["tps_processed"] == 500 and r["data_time_frac"] == 0.25
    assert r["tflops"] == 500 * 10.0 / 1e12 and r["mfu"] == 100 * r["tflops"]
    assert r["tflops_doc"] == (1000 * 4.0 + 300 * 0.5) / 2 / 1e12 and r["profiled"] is True
    assert r["mfu_doc"] == 100 * r["tflops_doc"]
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["tps_processed"] == 500 and row["mfu_doc"] == r["mfu_doc"]


def _event(name, start, end, device=DeviceType.CUDA, annotation=False):
    rng = SimpleNamespace(start=start, end=end)
    return SimpleNamespace(
        name=name, time_range=rng, cpu_parent=None, device_type=device,
        is_user_annotation=annotation,
    )  # fmt: skip


def test_exposed_collectives_and_idle():
    split = exposed_and_idle([(0, 50)], [(20, 70)], 100.0)
    assert split == {"busy_us": 70, "exposed_us": 20, "idle_us": 30}
    events = [
        _event("ncclDevKernel_AllGather", 0, 50),
        _event("sm90_gemm", 20, 70),
        _event("Optimizer.step#AdamW.step", 0, 100, annotation=True),  # spans kernels: skipped
        _event("DataLoader#_SingleProcessDataLoaderIter.__next__", 80, 90, DeviceType.CPU),
    ]  # fmt: skip
    s = time_shares(events, 100.0, on_gpu=True)
    assert (s["compute_share"], s["exposed_collectives_share"], s["idle_share"]) == (0.5, 0.2, 0.3)
    assert s["collectives_share"] == 0.5 and s["data_loading_share"] == 0.1


def test_profiler_window_follows_warmup_and_marks_steps(tmp_path):
    prof = CommProfiler(
        Metrics(comm_profile=True), str(tmp_path), torch.device("cpu"), True, 20, warmup_steps=5
    )
    covered = []
    for step in range(1, 12):
        prof.step(step)
        covered.append(prof.covers(step))
    prof.close()
    assert [s for s, c in zip(range(1, 12), covered) if c] == [6, 7, 8]
    assert json.loads((tmp_path / "comm_profile.json").read_text())["steps"] == [6, 8]
