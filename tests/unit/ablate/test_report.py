"""Report numbers and verdicts from hand-written run folders (no training)."""

import importlib.util
import json

import pytest

from tests.helpers.report_runs import make_run, plan, variant
from torchtitan_ablate.ablate.noise import noise_unknown
from torchtitan_ablate.ablate.plan import PLAN_FILE
from torchtitan_ablate.ablate.report import build_rows, write_report
from torchtitan_ablate.ablate.runner import error_line


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
    assert b["speedup"] == 201 / 102 and "beyond the noise" in b["verdict"]
    assert b["memory_ratio"] == 1.5 and b["memory_ratio_basis"] == "predicted"
    assert "within the seed spread" in b["verdict"]  # 2.04 vs 2.05, spread 0.1
    assert abs(a["final_loss_mean"] - 2.05) < 1e-9 and abs(a["final_loss_spread"] - 0.1) < 1e-9
    assert c["status"] == "partial (1 failed)" and "RuntimeError: x" in c["error"]
    assert "noise unknown: fewer than 10 steady steps" in c["verdict"]  # one seed, 3 steps
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
    assert names == [
        "loss.png", "throughput.png", "memory.png", "tokens_vs_batch.png", "memory_vs_batch.png"
    ]  # fmt: skip
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


def _legend_texts(fig) -> list[list[str]]:
    from matplotlib.legend import Legend

    (ax,) = fig.axes
    legends = [c for c in ax.get_children() if isinstance(c, Legend)]
    return [[t.get_text() for t in leg.get_texts()] for leg in legends]


def test_loss_plot_has_a_seed_legend_and_integer_steps(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from torchtitan_ablate.ablate.plots import loss_figure

    curve = [(1, 3.0), (2, 2.5), (3, 2.2)]
    rows = [
        {"variant": "a", "curves": {42: curve, 43: curve}},
        {"variant": "b", "curves": {43: curve}},  # seed 42 failed
        {"variant": "c", "curves": {}},  # no finished run: not in the legend
    ]
    fig = loss_figure(plt, rows)
    assert sorted(_legend_texts(fig)) == [["a", "b"], ["seed 42", "seed 43"]]
    (ax,) = fig.axes
    assert all(float(t).is_integer() for t in ax.get_xticks())
    # b's only line is seed 43's: the style of seed 43 in a, not the first style.
    styles = [line.get_linestyle() for line in ax.get_lines()]
    assert styles == ["-", "--", "--"]
    plt.close(fig)
    fig = loss_figure(plt, rows[1:])  # one seed: nothing for a seed legend to tell apart
    assert _legend_texts(fig) == [["b"]]
    plt.close(fig)


def _packing_study(tmp_path, packings, tokens_per_step=(256, 256), tokens_seen=False):
    variants = []
    for name, packing, tps in zip(("packed", "padded"), packings, tokens_per_step):
        runs = [make_run(tmp_path, name, s, [1, 10, 10], [3, 2, 1], packing=packing)
                for s in (1, 2)]  # fmt: skip
        if tokens_seen:
            for run in runs:
                path = tmp_path / run["dir"] / "metrics.jsonl"
                records = [json.loads(x) for x in path.read_text().splitlines()]
                for r in records:
                    r["tokens_seen"] = 100 * r["step"]
                path.write_text("".join(json.dumps(r) + "\n" for r in records))
        variants.append(variant(name, runs, tokens_per_step=tps))
    plan(tmp_path, variants)


@pytest.mark.parametrize(
    "packings, tokens_per_step, plotted",
    [
        (("greedy", "padding"), (256, 256), True),  # a packing study
        (("greedy", "greedy"), (256, 512), True),  # different tokens per step
        (("greedy", "greedy"), (256, 256), False),  # steps say it all
        ((None, None), (256, 256), False),  # no config.toml: nothing tells them apart
    ],
)
def test_loss_vs_tokens_plot_when_tokens_or_packing_differ(
    tmp_path, packings, tokens_per_step, plotted
):
    pytest.importorskip("matplotlib")
    _packing_study(tmp_path, packings, tokens_per_step)
    write_report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert ("![loss_vs_tokens](loss_vs_tokens.png)" in md) == plotted
    assert (tmp_path / "loss_vs_tokens.png").is_file() == plotted


@pytest.mark.parametrize("logged", [False, True])
def test_tokens_seen_logged_or_derived(tmp_path, logged):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from torchtitan_ablate.ablate.plots import loss_figure

    _packing_study(tmp_path, ("greedy", "padding"), (256, 512), tokens_seen=logged)
    _, rows = build_rows(tmp_path)
    assert rows[0]["packing"] == "greedy" and rows[1]["packing"] == "padding"
    per_step = 100 if logged else 512  # the trainer's count, else step x global batch x seq_len
    assert [x for x, _ in rows[1]["token_curves"][1]] == [per_step, 2 * per_step, 3 * per_step]
    fig = loss_figure(plt, rows, "token_curves")
    label = fig.axes[0].get_xlabel()
    assert ("trainer's count" in label) == logged and ("padding included" in label) != logged
    assert sorted(_legend_texts(fig)) == [["packed", "padded"], ["seed 1", "seed 2"]]
    plt.close(fig)


def test_header_shows_the_overrides_and_the_values_as_run(tmp_path):
    runs = [make_run(tmp_path, "a", 1, [1, 10, 11, 12], [3, 2, 1, 0.5])]
    sets = ["model.flavor=debugmodel", "training.seq_len=64"]
    plan(
        tmp_path,
        [variant("a", runs, flavor="debugmodel", global_batch_size=4),
         variant("b", [], flavor="debugmodel", global_batch_size=8),
         variant("c", [], error="variant 'c': bad")],
        sets=sets,
        overrides={"metrics.log_freq": 1, "float8.filter_fqns": ["output", "router"]},
        description="Qwen3-0.6B, seq 4096",
    )  # fmt: skip
    write_report(tmp_path)
    header = (tmp_path / "report.md").read_text().split("## Results")[0]
    assert "`--set`" in header and "`model.flavor=debugmodel`, `training.seq_len=64`" in header
    assert "`metrics.log_freq=1`, `float8.filter_fqns=output,router`" in header
    assert "As run: model debugmodel, seq_len 64, 4 steps, global batch 4/8 sequences" in header
    assert "differs by variant" in header and "0.6B" not in header.split("As run")[1]


def test_noise_budget_hit_profile_columns_and_breakdown_plot(tmp_path):
    tps = [1.0] + [100.0, 104.0] * 6  # 12 steady steps: the interval is min to max, +-2%
    runs = [make_run(tmp_path, "a", 1, tps, [1.0] * 13)]
    profile = {"compute_share": 0.6, "collectives_share": 0.3, "exposed_collectives_share": 0.1,
               "idle_share": 0.3, "gpu_util_pct": None, "method": "CUDA"}  # fmt: skip
    (tmp_path / "runs/a/seed1/comm_profile.json").write_text(json.dumps(profile))
    plan(tmp_path, [variant("a", runs)])
    doc = json.loads((tmp_path / PLAN_FILE).read_text())
    doc["spec"]["noise_target"] = 0.01
    (tmp_path / PLAN_FILE).write_text(json.dumps(doc))
    rows = write_report(tmp_path)
    a = rows[0]
    assert abs(a["tps_noise_pct"] - 100 * 2 / 102) < 1e-9 and a["noise_note"] == "budget hit"
    assert (a["compute_pct"], a["exposed_comm_pct"], a["idle_pct"]) == (60.0, 10.0, 30.0)
    md = (tmp_path / "report.md").read_text()
    assert "+-2.0% (budget hit)" in md and "| 60 / 10 / 30 |" in md
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "step_breakdown.png").is_file()
        from torchtitan_ablate.ablate.plots import step_breakdown

        assert step_breakdown({**a, "data_pct": 5.0}) == [60.0, 10.0, 5.0, 25.0]


def test_runs_stopped_at_different_steps_compare_losses_at_the_common_step(tmp_path):
    # A noise target stops a run early: its last loss is from an earlier step than the
    # baseline's, so the verdict compares both at the step the shorter run reached.
    a = [make_run(tmp_path, "a", 1, [10] * 6, [6.0, 5.0, 4.0, 3.0, 2.0, 1.0])]
    b = [make_run(tmp_path, "b", 1, [10] * 3, [6.0, 5.0, 4.5])]  # stopped at step 3
    plan(tmp_path, [variant("a", a), variant("b", b)])
    write_report(tmp_path)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert rows[1]["final_loss_mean"] == 4.5  # the table keeps each run's own last loss
    assert (
        "loss at step 3 (where the shorter run stopped) 4.5000 vs 4.0000 (+0.5000"
        in (rows[1]["verdict"])
    )
    # Runs of one length: the final losses, as before.
    c = tmp_path / "same"
    c.mkdir()
    runs = [make_run(c, n, 1, [10] * 3, [6.0, 5.0, x]) for n, x in (("a", 4.0), ("b", 4.5))]
    plan(c, [variant("a", [runs[0]]), variant("b", [runs[1]])])
    write_report(c)
    rows = json.loads((c / "results.json").read_text())["rows"]
    assert "final loss 4.5000 vs 4.0000 (+0.5000; one seed" in rows[1]["verdict"]


def test_variants_compare_with_the_baseline_they_name(tmp_path):
    # Two model sizes in one file: each size's variants compare with that size's own baseline.
    runs = {n: [make_run(tmp_path, n, 1, [1] + [t] * 12, [3.0] * 13)] for n, t in
            (("small", 100), ("small_fast", 150), ("big", 20), ("big_fast", 30))}  # fmt: skip
    variants = [variant(n, r) for n, r in runs.items()]
    variants[2]["baseline"] = "big"  # its own name: a baseline
    variants[3]["baseline"] = "big"
    plan(tmp_path, variants)
    _, rows = build_rows(tmp_path)
    small, small_fast, big, big_fast = rows
    assert small_fast["speedup"] == 1.5 and small_fast["baseline"] == "small"
    assert big["speedup"] == 1.0 and big["verdict"] == "big: baseline"
    assert big_fast["speedup"] == 1.5 and big_fast["verdict"].startswith("big_fast vs big:")
    write_report(tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "| 1.50x vs big |" in report and "| 1.50x |" in report


def test_plans_without_baselines_compare_with_the_first(tmp_path):
    runs = {n: [make_run(tmp_path, n, 1, [1] + [t] * 12, [3.0] * 13)] for n, t in
            (("a", 100), ("b", 50))}  # fmt: skip
    plan(tmp_path, [variant(n, r) for n, r in runs.items()])  # no "baseline" keys: older plans
    _, rows = build_rows(tmp_path)
    assert rows[1]["speedup"] == 0.5 and rows[1]["baseline"] == "a"


def test_a_short_run_is_marked_noise_unknown_and_the_title_says_what_ran(tmp_path):
    # Two logged steps, the first warm-up: each median is one step's figure, noise unknown.
    a = [make_run(tmp_path, "a", 1, [1, 100], [3.0, 2.0])]
    b = [make_run(tmp_path, "b", 1, [1, 128], [3.0, 2.0])]
    plan(tmp_path, [variant(n, r, flavor="debugmodel", steps=2) for n, r in (("a", a), ("b", b))],
         sets=["model.flavor=debugmodel"], description="Qwen3-1.7B, 4 GPUs")  # fmt: skip
    rows = write_report(tmp_path)
    assert [r["tps_steps"] for r in rows] == [1, 1]
    assert noise_unknown(rows[1]) == "n=1 step: noise unknown"
    assert rows[1]["verdict"].startswith(
        "b vs a: 1.28x tokens/s (+28.0%; noise unknown: fewer than 10 steady steps (b n=1 step, "
        "a n=1 step), so not a measured speedup)"
    )
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# Ablation: t (debugmodel, CPU, 1 process, 2 steps)\n")
    assert "Qwen3-1.7B, 4 GPUs (the ablation file's description; `--set` changed" in md
    assert "| 128 (n=1 step: noise unknown) | unknown | 1.28x (noise unknown) |" in md
    assert "| 100 (n=1 step: noise unknown) | unknown | 1.00x |" in md


def test_the_throughput_plot_hatches_a_median_of_unknown_noise(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from torchtitan_ablate.ablate.plots import throughput_figure

    known = {"variant": "a", "tps_median": 100.0, "tps_noise_pct": 5.0, "tps_steps": 20}
    short = {"variant": "b", "tps_median": 128.0, "tps_noise_pct": None, "tps_steps": 1}
    fig = throughput_figure(plt, [known, short])
    (ax,) = fig.axes
    assert [p.get_hatch() for p in ax.patches] == [None, "//"]
    assert [t.get_text() for t in ax.texts] == ["n=1 step:\nnoise unknown"]
    # One error bar, a's: none of zero width drawn for b.
    assert [type(c).__name__ for c in ax.containers].count("ErrorbarContainer") == 1
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["noise unknown"]
    plt.close(fig)
