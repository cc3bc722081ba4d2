"""Report numbers and verdicts from hand-written run folders (no training)."""

import json

import pytest

from torchtitan_ablate.ablate.report import build_rows, write_report
from torchtitan_ablate.ablate.runner import PLAN_FILE, error_line

ENV = {"git_commit": "abc", "git_dirty": False, "python": "3", "torch": "2", "cuda": None}
ENV |= {"platform": "p", "cpu": "c", "cpu_count": 2, "gpus": []}


def make_run(out, variant, seed, tps, losses, status="ok", error=None, validation=None):
    run_dir = out / "runs" / variant / f"seed{seed}"
    run_dir.mkdir(parents=True)
    records = [
        {"step": i + 1, "loss": loss, "tps": t, "tflops": 1.0, "mfu": 0.0,
         "memory_max_active_gib": 0.0, "memory_max_reserved_gib": 0.0}
        for i, (t, loss) in enumerate(zip(tps, losses))
    ]  # fmt: skip
    for step, value in (validation or {}).items():
        records[step - 1]["validation_loss"] = value
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    status_doc = {"status": status, "returncode": 0 if status == "ok" else 1, "command": "x"}
    if error:
        status_doc["error"] = error
    (run_dir / "status.json").write_text(json.dumps(status_doc))
    return {"seed": seed, "dir": f"runs/{variant}/seed{seed}", "args": [], "command": "cmd"}


def plan(out, variants):
    spec = {"name": "t", "description": "", "config_file": "c.toml", "throughput_warmup_steps": 1}
    doc = {"spec": spec, "command": ["ablate"], "ngpu": 1, "variants": variants, "environment": ENV}
    (out / PLAN_FILE).write_text(json.dumps(doc))


def variant(name, runs, predicted=None, error=None):
    layout = {"global_batch_size": 4, "grad_accum": 1, "tokens_per_step": 256, "steps": 4}
    memory = {"predicted_peak_gib": predicted, "fits": None if predicted is None else True}
    return {"name": name, "group": name, "error": error, "layout": layout, "runs": runs,
            "memory": {**memory, "note": ""}}  # fmt: skip


def test_rows_noise_and_verdicts(tmp_path):
    base = [
        make_run(tmp_path, "a", 1, [1, 100, 102, 98], [5.0, 4.0, 3.0, 2.00]),
        make_run(tmp_path, "a", 2, [1, 104, 106, 102], [5.0, 4.0, 3.0, 2.10]),
    ]
    fast = [
        make_run(tmp_path, "b", 1, [1, 200, 200, 200], [5.0, 4.0, 3.0, 2.02]),
        make_run(tmp_path, "b", 2, [1, 202, 202, 202], [5.0, 4.0, 3.0, 2.06]),
    ]
    same = [
        make_run(tmp_path, "c", 1, [1, 101, 101, 101], [5.0, 4.0, 3.0, 2.5]),
        make_run(tmp_path, "c", 2, [1, 0, 0, 0], [5.0], status="failed", error="RuntimeError: x"),
    ]
    plan(tmp_path, [variant("a", base, 2.0), variant("b", fast, 3.0), variant("c", same),
                    variant("d", [], error="variant 'd': unknown key 'training.x'")])  # fmt: skip
    _, rows = build_rows(tmp_path)
    a, b, c, d = rows
    assert a["tps_median"] == 102  # step 1 is warm-up; steps 2-4 of both seeds
    assert abs(a["tps_noise_pct"] - 100 * (104 - 100) / 2 / 102) < 1e-9  # half the seed range
    assert b["speedup"] == 201 / 102 and "beyond the run-to-run noise" in b["verdict"]
    assert b["memory_ratio"] == 1.5 and b["memory_ratio_basis"] == "predicted"
    assert "within the seed spread" in b["verdict"]  # 2.04 vs 2.05, spread 0.1
    assert abs(a["final_loss_mean"] - 2.05) < 1e-9 and abs(a["final_loss_spread"] - 0.1) < 1e-9
    assert c["status"] == "partial (1 failed)" and "RuntimeError: x" in c["error"]
    assert "within the run-to-run noise" in c["verdict"]  # 101 vs 102 with one seed's noise
    assert "beyond the seed spread" in c["verdict"]
    assert d["status"] == "invalid" and "training.x" in d["verdict"]


def test_report_files(tmp_path):
    runs = [make_run(tmp_path, "a", 1, [1, 10, 11, 12], [3, 2, 1, 0.5])]
    plan(tmp_path, [variant("a", runs), variant("b", [])])
    write_report(tmp_path)
    for name in ("results.csv", "results.json", "report.md"):
        assert (tmp_path / name).is_file()
    md = (tmp_path / "report.md").read_text()
    assert "| a | 1/1 |" in md and "## Commands" in md and "git commit: `abc`" in md
    assert json.loads((tmp_path / "results.json").read_text())["rows"][1]["status"] == "not run"


def test_error_line_skips_launcher_noise(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(
        "Traceback (most recent call last):\n"
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
        "  error_file: <N/A>\n"
    )
    assert error_line(log, 1).endswith("CUDA out of memory. Tried to allocate 2 GiB")
    log.write_text("")
    assert "signal 9" in error_line(log, -9)


def test_sweep_plots(tmp_path):
    pytest.importorskip("matplotlib")
    from torchtitan_ablate.ablate.plots import make_plots

    rows = []
    for group, gbs, ga, tps in [
        ("z3", 2, 1, 10),
        ("z3", 4, 1, 18),
        ("z3", 8, 2, 20),
        ("z2", 2, 1, 12),
    ]:
        rows.append({"variant": f"{group}_{gbs}_{ga}", "group": group, "tps_median": tps,
                     "tps_noise_pct": 5.0, "tokens_per_step": gbs * 64, "global_batch_size": gbs,
                     "grad_accum": ga, "memory_measured_gib": None, "memory_predicted_gib": 1.0,
                     "curves": {1: [(1, 3.0), (2, 2.5)]}})  # fmt: skip
    names = make_plots(rows, tmp_path)
    assert names == ["loss.png", "throughput.png", "memory.png", "tokens_vs_batch.png"]
    assert all((tmp_path / n).stat().st_size > 1000 for n in names)


def test_validation_loss_column_and_verdict(tmp_path):
    tps, losses = [1, 10, 10, 10], [5.0, 4.0, 3.0, 2.0]
    a = [make_run(tmp_path, "a", s, tps, losses, validation={2: 9.0, 4: v}) for s, v in
         ((1, 3.0), (2, 3.2))]  # fmt: skip
    b = [make_run(tmp_path, "b", 1, tps, losses, validation={4: 2.9})]
    c = [make_run(tmp_path, "c", 1, tps, losses)]  # no [validation]: no figure, no comparison
    plan(tmp_path, [variant("a", a), variant("b", b), variant("c", c)])
    write_report(tmp_path)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert abs(rows[0]["validation_loss_mean"] - 3.1) < 1e-9  # last validation of each seed
    assert rows[1]["validation_loss_mean"] == 2.9 and rows[2]["validation_loss_mean"] is None
    assert "validation loss 2.9000 vs 3.1000 (-0.2000)" in rows[1]["verdict"]
    assert "validation" not in rows[2]["verdict"]
    md = (tmp_path / "report.md").read_text()
    assert "validation loss (mean) |" in md and "| 3.1000 |" in md and "| n/a |" in md
