"""scripts/trace_gaps.py: GPU idle gaps charged to their neighbouring kernels and a cause."""

import gzip
import importlib.util
import json

SPEC = importlib.util.spec_from_file_location("trace_gaps", "scripts/trace_gaps.py")
trace_gaps = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(trace_gaps)


def _kernel(name, ts, dur, corr):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _launch(ts, corr):
    return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1,
            "args": {"correlation": corr}}  # fmt: skip


EVENTS = [
    _kernel("gemm(a)", 0, 10, 1),
    _launch(0, 1),
    # Launched at 5, long before the GPU ran dry at 10, started at 100: waited on something.
    _kernel("ncclDevKernel_SendRecv(x)", 100, 10, 2),
    _launch(5, 2),
    # A kernel on another stream inside the busy time: no gap, and it does not end the span.
    _kernel("copy", 102, 3, 3),
    _launch(6, 3),
    # Launched at 150, after the GPU went idle at 110: the CPU was late.
    _kernel("void triton_poi(y)", 160, 10, 4),
    _launch(150, 4),
    _kernel("gemm(a)", 180, 5, 5),
    _launch(151, 5),  # 10 us gap: under --min-us
]


def test_gaps_are_charged_to_neighbours_and_cause():
    total, pairs = trace_gaps.idle_gaps(EVENTS, min_us=20)
    assert total == 90 + 50
    assert dict(pairs) == {
        ("gemm", "ncclDevKernel_SendRecv", "dependency"): [1, 90.0],
        ("ncclDevKernel_SendRecv", "triton_poi", "cpu-late"): [1, 50.0],
    }


def test_main_reads_gzipped_traces_and_rejects_others(tmp_path, capsys):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    assert trace_gaps.main([str(path), "--min-us", "20", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "0.14 ms per step" in out and "| gemm | ncclDevKernel_SendRecv | dependency | 1 |" in out
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    assert trace_gaps.main([str(bad)]) == 2
    assert "cannot read" in capsys.readouterr().err
