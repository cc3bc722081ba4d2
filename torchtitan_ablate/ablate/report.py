"""The report of a finished (or partly finished) ablation, from OUT/ablation.json and the run
folders only: results.csv, results.json, report.md and the plots.

Noise of a variant's median tokens/s: half the width of the distribution-free 95% confidence
interval of the median of its steady-state step tokens/s (order statistics, at least 10 steps;
the profiled steps left out), relative to the median; with 2+ finished seeds, the larger of that
and half the range of the per-seed medians relative to their median. "(budget hit)": the
ablation's noise_target was not reached within its steps. A speedup is called within noise
when |speedup - 1| is at most the baseline's noise plus the variant's. A final-loss difference
is within noise when it is at most the larger of the two variants' seed ranges (max - min of the
final loss over seeds). A median from fewer steady steps (one seed) has no known noise: the
table, the verdict and the plots mark it "n=K steps: noise unknown" (a hatched grey bar), and its
speedup is not a measured one.
"""

import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from torchtitan_ablate.ablate import pipeline_columns
from torchtitan_ablate.ablate.noise import noise_unknown
from torchtitan_ablate.ablate.plan import read_plan, read_status
from torchtitan_ablate.components.observability.metrics import MIN_NOISE_SAMPLES, median_noise

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

COLUMNS = [
    "variant", "group", "status", "runs_ok", "runs", "ngpu", "steps_run", "tps_median",
    "tps_steps", "tps_noise_pct", "noise_note", "speedup", "baseline", "tps_processed_median",
    "tflops", "mfu_pct",
    "mfu_doc_pct", "memory_measured_gib", "memory_reserved_gib", "memory_predicted_gib",
    "fits_predicted", "memory_ratio", "memory_ratio_basis", "final_loss_mean",
    "final_loss_spread", "final_loss_std", "validation_loss_mean", "global_batch_size",
    "grad_accum", "tokens_per_step", "compute_pct", "exposed_comm_pct", "idle_pct", "data_pct",
    "comm_pct", "gpu_util_pct", "profile_method", *pipeline_columns.COLUMNS, "error", "verdict",
]  # fmt: skip
# Keys of the trainer's metrics.jsonl the report takes steady-state medians of (a file without
# one of them gives n/a in its column).
STEADY_KEYS = {
    "tps": "tps_median", "tps_processed": "tps_processed_median", "tflops": "tflops",
    "mfu": "mfu_pct", "mfu_doc": "mfu_doc_pct", "data_time_frac": "data_pct",
}  # fmt: skip
TOKENS_KEY = "tokens_seen"  # the trainer's cumulative global token count, where it logs one


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def read_run_config(run_dir: Path) -> dict:
    """The trainer's resolved config.toml of a run ({} when missing or unreadable)."""
    try:
        return tomllib.loads((run_dir / "config.toml").read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return {}


def token_curve(records: list[dict], tokens_per_step: int | None) -> tuple[list, str] | None:
    """(tokens seen, loss) per logged step and where the count comes from: "logged" (the
    trainer's count) when every record has it, else "derived" = step x global batch x seq_len,
    which counts padding; None without either."""
    if records and all(TOKENS_KEY in r for r in records):
        return [(r[TOKENS_KEY], r["loss"]) for r in records], "logged"
    if tokens_per_step:
        return [(r["step"] * tokens_per_step, r["loss"]) for r in records], "derived"
    return None


def _noise(per_seed: list[float], steps: list[float], target: float | None) -> tuple:
    """(noise in %, note): the confidence interval of the median, widened to the seeds' spread;
    note "budget hit" when a noise target was set and not reached."""
    noise = median_noise(steps)
    if len(per_seed) >= 2:
        spread = (max(per_seed) - min(per_seed)) / 2 / statistics.median(per_seed)
        noise = spread if noise is None else max(noise, spread)
    hit = target is not None and (noise is None or noise > target)
    return (None if noise is None else 100 * noise), ("budget hit" if hit else None)


def _median_of(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _profile_columns(row: dict, profiles: list[dict]) -> None:
    """compute / exposed collectives / idle / all collectives % from comm_profile.json (mean
    over seeds) and NVML utilisation."""
    for key, share in (("compute_pct", "compute_share"), ("comm_pct", "collectives_share"),
                       ("exposed_comm_pct", "exposed_collectives_share"),
                       ("idle_pct", "idle_share")):  # fmt: skip
        vals = [p[share] for p in profiles if p.get(share) is not None]
        row[key] = 100 * statistics.fmean(vals) if vals else None
    vals = [p["gpu_util_pct"] for p in profiles if p.get("gpu_util_pct") is not None]
    row["gpu_util_pct"] = statistics.fmean(vals) if vals else None
    methods = {p.get("method") for p in profiles} - {None}
    row["profile_method"] = ", ".join(sorted(methods)) or None


def summarize_variant(
    variant: dict, out: Path, warmup: int, noise_target: float | None = None
) -> dict[str, Any]:
    """One row: throughput, memory and loss over the variant's finished seeds."""
    row: dict[str, Any] = {c: None for c in COLUMNS}
    layout = variant.get("layout", {})
    memory = variant.get("memory", {})
    row.update(
        variant=variant["name"],
        group=variant["group"],
        runs=len(variant.get("runs", [])),
        ngpu=layout.get("ngpu"),
        memory_predicted_gib=memory.get("predicted_peak_gib"),
        fits_predicted=memory.get("fits"),
        global_batch_size=layout.get("global_batch_size"),
        grad_accum=layout.get("grad_accum"),
        tokens_per_step=layout.get("tokens_per_step"),
        packing=None,  # training.packing of the runs, from their config.toml (for the plots)
    )
    if variant["error"]:
        row.update(status="invalid", runs_ok=0, error=variant["error"])
        return row
    per_seed_tps, finals, active, reserved, steps_run = [], [], [], [], []
    steady: dict[str, list] = {key: [] for key in STEADY_KEYS}
    errors, profiles, curves, held_out = [], [], {}, []
    token_curves, token_bases = {}, set()
    for run in variant["runs"]:
        run_dir = out / run["dir"]
        status = read_status(run_dir)
        if status is None:
            continue
        if status["status"] != "ok":
            errors.append(f"seed {run['seed']}: {status.get('error', 'failed')}")
            continue
        records = read_metrics(run_dir)
        if not records:
            errors.append(f"seed {run['seed']}: no metrics.jsonl")
            continue
        curves[run["seed"]] = [(r["step"], r["loss"]) for r in records]
        if tokens := token_curve(records, row["tokens_per_step"]):
            token_curves[run["seed"]] = tokens[0]
            token_bases.add(tokens[1])
        if row["packing"] is None:
            row["packing"] = read_run_config(run_dir).get("training", {}).get("packing")
        # Short runs (e.g. --set training.steps=5) keep at least their second half.
        skip = min(warmup, records[-1]["step"] // 2)
        kept = [r for r in records if r["step"] > skip and not r.get("profiled")]
        kept = kept or records[-1:]
        for key in STEADY_KEYS:
            steady[key] += [r[key] for r in kept if key in r]
        per_seed_tps.append(statistics.median(r["tps"] for r in kept))
        steps_run.append(records[-1]["step"])
        finals.append(records[-1]["loss"])
        validated = [r["validation_loss"] for r in records if "validation_loss" in r]
        held_out += validated[-1:]
        # CPU runs log null memory (older versions 0.0 GiB without a percentage).
        if any(r.get("memory_max_reserved_pct") is not None for r in records):
            active.append(max(r["memory_max_active_gib"] for r in records))
            reserved.append(max(r["memory_max_reserved_gib"] for r in records))
        profile = run_dir / "comm_profile.json"
        if profile.is_file():
            profiles.append(json.loads(profile.read_text()))
    row.update(curves=curves, token_curves=token_curves, token_bases=sorted(token_bases))
    row["runs_ok"] = len(finals)
    row["error"] = "; ".join(errors) or None
    if not finals:
        row["status"] = "failed" if errors else "not run"
        return row
    row["status"] = "ok" if len(finals) == row["runs"] else f"partial ({len(errors)} failed)"
    for key, column in STEADY_KEYS.items():
        row[column] = _median_of(steady[key])
    row["tps_noise_pct"], row["noise_note"] = _noise(per_seed_tps, steady["tps"], noise_target)
    row["tps_steps"] = len(steady["tps"])  # the steady steps the median is taken over
    row["steps_run"] = max(steps_run)
    for key in ("mfu_pct", "mfu_doc_pct"):  # null (older versions 0) without a known peak
        row[key] = row[key] or None
    if row["data_pct"] is not None:
        row["data_pct"] *= 100
    row["memory_measured_gib"] = max(active) if active else None
    row["memory_reserved_gib"] = max(reserved) if reserved else None
    row["final_loss_mean"] = statistics.fmean(finals)
    if len(finals) >= 2:
        row["final_loss_spread"] = max(finals) - min(finals)
        row["final_loss_std"] = statistics.stdev(finals)
    # Only when every finished run validated: a mean over some seeds would mislead.
    row["validation_loss_mean"] = (
        statistics.fmean(held_out) if len(held_out) == len(finals) else None
    )
    _profile_columns(row, profiles)
    pipeline_columns.fill(row, profiles)  # bubble and per-stage memory under PP
    return row


def compare(row: dict, base: dict) -> None:
    """Speedup, memory ratio and the one-line verdict of row against the baseline row."""
    name = row["variant"]
    row["baseline"] = base["variant"]
    if row["tps_median"] is None:
        row["verdict"] = f"{name}: {row['status']}: {row['error'] or 'no finished run'}"
        return
    if row is base:
        row["speedup"] = 1.0
        for basis in ("measured", "predicted"):
            if row[f"memory_{basis}_gib"]:
                row["memory_ratio"], row["memory_ratio_basis"] = 1.0, basis
                break
        row["verdict"] = f"{name}: baseline"
        return
    if base["tps_median"] is None:
        row["verdict"] = f"{name}: no comparison (baseline {base['variant']} has no finished run)"
        return
    parts = []
    speedup = row["tps_median"] / base["tps_median"]
    row["speedup"] = speedup
    change = f"{speedup:.2f}x tokens/s ({100 * (speedup - 1):+.1f}%"
    if row["tps_noise_pct"] is None or base["tps_noise_pct"] is None:
        counts = ", ".join(
            f"{r['variant']} {noise_unknown(r).split(':')[0]}"
            for r in (row, base)
            if noise_unknown(r)
        )
        parts.append(
            f"{change}; noise unknown: fewer than {MIN_NOISE_SAMPLES} steady steps ({counts}), "
            "so not a measured speedup)"
        )
    else:
        noise = (row["tps_noise_pct"] + base["tps_noise_pct"]) / 100
        within = "within" if abs(speedup - 1) <= noise else "beyond"
        hit = " (budget hit)" if row["noise_note"] or base["noise_note"] else ""
        parts.append(f"{change}, {within} the noise of +-{100 * noise:.1f}%{hit})")
    for basis, key in (("measured", "memory_measured_gib"), ("predicted", "memory_predicted_gib")):
        if row[key] and base[key]:
            row["memory_ratio"] = row[key] / base[key]
            row["memory_ratio_basis"] = basis
            parts.append(f"peak memory {row['memory_ratio']:.2f}x ({basis})")
            break
    else:
        parts.append("peak memory not measured or predicted")
    (mine, base_loss), spreads, what = _losses_to_compare(row, base)
    delta = mine - base_loss
    loss = f"{what} {mine:.4f} vs {base_loss:.4f} ({delta:+.4f}"
    if spreads:
        within = "within" if abs(delta) <= max(spreads) else "beyond"
        parts.append(f"{loss}, {within} the seed spread {max(spreads):.4f})")
    else:
        parts.append(f"{loss}; one seed: loss noise unknown)")
    if row["validation_loss_mean"] is not None and base["validation_loss_mean"] is not None:
        val, base_val = row["validation_loss_mean"], base["validation_loss_mean"]
        parts.append(f"validation loss {val:.4f} vs {base_val:.4f} ({val - base_val:+.4f})")
    row["verdict"] = f"{name} vs {base['variant']}: " + "; ".join(parts)


def _losses_to_compare(row: dict, base: dict) -> tuple[tuple[float, float], list[float], str]:
    """(row's, base's) mean loss, their seed spreads and what they are: the final losses, or,
    where runs stopped at different steps (noise_target stops a run early), the losses at the
    last step every run of both variants reached: losses of different steps do not compare."""
    runs = [c for r in (row, base) for c in (r.get("curves") or {}).values() if c]
    ends = {c[-1][0] for c in runs}
    if len(ends) <= 1:
        spreads = [
            r["final_loss_spread"] for r in (row, base) if r["final_loss_spread"] is not None
        ]
        return (row["final_loss_mean"], base["final_loss_mean"]), spreads, "final loss"
    step = min(ends)
    means, spreads = [], []
    for r in (row, base):
        # The last logged loss at or before `step` (log_freq may skip it).
        at = [[loss for s, loss in c if s <= step][-1] for c in r["curves"].values() if c]
        means.append(statistics.fmean(at))
        if len(at) >= 2:
            spreads.append(max(at) - min(at))
    return (means[0], means[1]), spreads, f"loss at step {step} (where the shorter run stopped)"


def build_rows(out: Path) -> tuple[dict, list[dict]]:
    plan = read_plan(out)
    warmup = plan["spec"]["throughput_warmup_steps"]
    target = plan["spec"].get("noise_target")
    rows = [summarize_variant(v, out, warmup, target) for v in plan["variants"]]
    by_name = {row["variant"]: row for row in rows}
    for row, variant in zip(rows, plan["variants"]):
        # A variant that names no baseline compares with the first.
        compare(row, by_name.get(variant.get("baseline"), rows[0]))
    return plan, rows


def write_report(out: Path) -> list[dict]:
    """Writes results.csv/json, the plots and report.md into out; returns the rows."""
    from torchtitan_ablate.ablate.markdown import render
    from torchtitan_ablate.ablate.plots import make_plots

    out = Path(out)
    plan, rows = build_rows(out)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    table = [{c: r[c] for c in COLUMNS} for r in rows]
    (out / "results.json").write_text(
        json.dumps({"ablation": plan["spec"]["name"], "rows": table}, indent=1) + "\n"
    )
    plots = make_plots(rows, out)
    noise = " ".join(__doc__.split("\n\n")[1].split())  # the module docstring's definition
    (out / "report.md").write_text(render(plan, rows, plots, out, noise))
    return rows
