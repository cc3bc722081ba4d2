"""The report's pipeline-parallel columns from hand-written comm_profile.json files (no
training): the bubbles, measured and theoretical, and the per-pp-rank peak memory."""

import json

import pytest

from tests.helpers.report_runs import make_run, plan, variant
from torchtitan_ablate.ablate.report import write_report


def test_pipeline_bubble_columns(tmp_path):
    def entry(mean, peaks):
        stages = [{"pp_rank": r, "ranks": 1, "measured_bubble": mean, "peak_active_gib": p}
                  for r, p in enumerate(peaks)]  # fmt: skip
        return {"schedule": "1F1B", "degree": 2, "microbatches": 4, "stages_per_rank": 1,
                "theoretical_bubble": 0.2, "measured_bubble_mean": mean,
                "measured_bubble_max": mean + 0.1, "per_pp_rank": stages}  # fmt: skip

    pp = [make_run(tmp_path, "pp", s, [1, 10, 10], [3, 2, 1]) for s in (1, 2)]
    flat = [make_run(tmp_path, "flat", 1, [1, 10, 10], [3, 2, 1])]
    for seed, mean, peaks in ((1, 0.3, [2.0, 1.5]), (2, 0.5, [2.5, 1.0])):
        doc = {"compute_share": 1 - mean, "pipeline": entry(mean, peaks)}
        (tmp_path / f"runs/pp/seed{seed}/comm_profile.json").write_text(json.dumps(doc))
    (tmp_path / "runs/flat/seed1/comm_profile.json").write_text(json.dumps({"compute_share": 1}))
    plan(tmp_path, [variant("flat", flat), variant("pp", pp)])
    flat_row, pp_row = write_report(tmp_path)
    assert pp_row["bubble_measured_pct"] == pytest.approx(40)  # mean over seeds of 30 and 50
    assert pp_row["bubble_measured_max_pct"] == pytest.approx(50)
    assert pp_row["bubble_theoretical_pct"] == pytest.approx(20)
    assert pp_row["stage_peak_gib"] == [2.5, 1.5]  # per pipeline rank, max over seeds
    assert flat_row["bubble_measured_pct"] is None and flat_row["stage_peak_gib"] is None
    md = (tmp_path / "report.md").read_text()
    head = "| bubble measured % (mean / max over pp ranks) | bubble theoretical % "
    assert head + "| peak mem per pp rank GiB |" in md
    assert "| 40 / 50 | 20 | 2.50 / 1.50 |" in md and "| n/a | n/a | n/a |" in md
    assert "Bubble (pipeline parallel)" in md
    # Without a pipelined run: no bubble columns.
    (tmp_path / "runs/pp/seed1/comm_profile.json").unlink()
    (tmp_path / "runs/pp/seed2/comm_profile.json").unlink()
    write_report(tmp_path)
    assert "bubble" not in (tmp_path / "report.md").read_text().lower()
