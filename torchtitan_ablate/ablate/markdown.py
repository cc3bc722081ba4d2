"""report.md: the results table, verdicts, noise definition, commands and environment."""

import json
import shlex
from pathlib import Path
from typing import Any

from torchtitan_ablate.ablate import pipeline_columns
from torchtitan_ablate.ablate.ablation_file import cli_arg
from torchtitan_ablate.ablate.noise import noise_unknown

# Layout values that the header states as run (after every override), in this order.
AS_RUN = (("flavor", "model {}"), ("seq_len", "seq_len {}"), ("steps", "{} steps"),
          ("global_batch_size", "global batch {} sequences"))  # fmt: skip


def _num(value: Any, fmt: str = ".2f") -> str:
    return "n/a" if value is None else format(value, fmt)


def _memory(row: dict) -> tuple[str, str]:
    measured = _num(row["memory_measured_gib"])
    if row["memory_measured_gib"] is None and row["status"] not in ("invalid", "not run"):
        measured = "n/a (CPU)"
    predicted = _num(row["memory_predicted_gib"])
    if row["fits_predicted"] is not None:
        predicted += " (fits)" if row["fits_predicted"] else " (does not fit)"
    return measured, predicted


def _noise(r: dict) -> str:
    if r["tps_noise_pct"] is None:
        shown = "unknown" if noise_unknown(r) else "n/a"
        return shown + (" (budget hit)" if r["noise_note"] else "")
    return f"+-{r['tps_noise_pct']:.1f}%" + (f" ({r['noise_note']})" if r["noise_note"] else "")


def results_table(rows: list[dict]) -> list[str]:
    profiled = any(r["compute_pct"] is not None for r in rows)
    validated = any(r["validation_loss_mean"] is not None for r in rows)
    head = (
        "| variant | runs ok | GPUs | steps | tokens/s/GPU (median) | noise | speedup "
        "| processed tokens/s/GPU | TFLOP/s | MFU % (doc) | peak mem measured GiB "
        "| predicted GiB | mem ratio | final loss (mean +- std) | data % |"
    )
    sep = "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    if validated:
        head += " validation loss (mean) |"
        sep += "---|"
    if profiled:
        head += " compute / exposed comm / idle % | all comm % | GPU util % |"
        sep += "---|---|---|"
    pipeline_head, pipeline_sep = pipeline_columns.header(rows)
    head, sep = head + pipeline_head, sep + pipeline_sep
    lines = [head, sep]
    by_name = {r["variant"]: r for r in rows}
    for r in rows:
        measured, predicted = _memory(r)
        loss = _num(r["final_loss_mean"], ".4f")
        if r["final_loss_std"] is not None:
            loss += f" +- {r['final_loss_std']:.4f}"
        ratio = _num(r["memory_ratio"])
        if r["memory_ratio"] is not None:
            ratio += f" ({r['memory_ratio_basis']})"
        speedup = "n/a" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        if r["speedup"] is not None and r["baseline"] != rows[0]["variant"]:
            speedup += f" vs {r['baseline']}"
        base = by_name.get(r["baseline"], r)
        if r["speedup"] is not None and r is not base and (noise_unknown(r) or noise_unknown(base)):
            speedup += " (noise unknown)"
        tps = _num(r["tps_median"], ",.0f")
        if noise_unknown(r):
            tps += f" ({noise_unknown(r)})"
        mfu = _num(r["mfu_pct"], ".1f")
        if r["mfu_doc_pct"] is not None:
            mfu += f" ({r['mfu_doc_pct']:.1f})"
        line = (
            f"| {r['variant']} | {r['runs_ok']}/{r['runs']} | {_num(r['ngpu'], 'd')} "
            f"| {_num(r['steps_run'], 'd')} "
            f"| {tps} | {_noise(r)} | {speedup} "
            f"| {_num(r['tps_processed_median'], ',.0f')} | {_num(r['tflops'], '.3g')} | {mfu} "
            f"| {measured} | {predicted} | {ratio} | {loss} | {_num(r['data_pct'], '.1f')} |"
        )
        if validated:
            line += f" {_num(r['validation_loss_mean'], '.4f')} |"
        if profiled:
            shares = [_num(r[k], ".0f") for k in ("compute_pct", "exposed_comm_pct", "idle_pct")]
            line += (
                f" {' / '.join(shares)} | {_num(r['comm_pct'], '.0f')} "
                f"| {_num(r['gpu_util_pct'], '.0f')} |"
            )
        lines.append(line + pipeline_columns.cells(r, rows))
    return lines


def _codes(items: list[str]) -> str:
    return ", ".join(f"`{x}`" for x in items)


def by_call(plan: dict, part: str) -> list[tuple[Any, list[str]]]:
    """The variants grouped by one part ("command", "sets" or "environment") of the runner's
    call that ran them, in order: one group unless a study ran in parts (--resume --only)
    that differ in it. Plans from before variants named their call have one call."""
    groups: dict[str, tuple[Any, list[str]]] = {}
    for v in plan["variants"]:
        value = (v.get("call") or plan)[part]
        groups.setdefault(json.dumps(value, sort_keys=True), (value, []))[1].append(v["name"])
    return list(groups.values())


def header(plan: dict) -> str:
    """What every run used: the recipe, the overrides that beat it (the file's [overrides] and
    steps, then the command line's --set, the last word) and the values as run, so a report of
    `--set model.flavor=debugmodel` never reads as the recipe's model."""
    spec = plan["spec"]
    shared = [] if spec.get("steps") is None else [f"training.steps={spec['steps']}"]
    shared += [cli_arg(k, v)[2:] for k, v in (spec.get("overrides") or {}).items()]
    lines = [f"Base recipe `{spec['config_file']}`."]
    if shared:
        lines.append(f"Ablation file overrides for every run: {_codes(shared)}.")
    sets = by_call(plan, "sets")
    if any(value for value, _ in sets):
        over = "the recipe and the ablation file"
        if spec["description"]:
            over = "the recipe, the ablation file and the description"
        if len(sets) == 1:
            lines.append(f"Command-line overrides (`--set`, over {over}): {_codes(sets[0][0])}.")
        else:
            parts = [f"{', '.join(names)}: {_codes(value) or 'none'}" for value, names in sets]
            lines.append(f"Command-line overrides (`--set`, over {over}): {'; '.join(parts)}.")
    layouts = [v["layout"] for v in plan["variants"] if not v.get("error") and v.get("layout")]
    as_run, varies = [], False
    for key, fmt in AS_RUN:
        values = sorted({lay[key] for lay in layouts if lay.get(key) is not None})
        if values:
            as_run.append(fmt.format("/".join(map(str, values))))
            varies |= len(values) > 1
    if as_run:
        note = " (a/b: differs by variant)" if varies else ""
        lines.append("As run: " + ", ".join(as_run) + note + ".")
    return " ".join(lines)


def _joined(values: list) -> str:
    """The distinct values, a/b where they differ by variant; "?" when none is known."""
    return "/".join(map(str, sorted({x for x in values if x is not None}))) or "?"


def title(plan: dict, rows: list[dict]) -> str:
    """The report's title: the study's name and what ran (model flavor, device, processes per
    run, steps run), from the plan and the run folders, not from the recipe or description."""
    layouts = [v["layout"] for v in plan["variants"] if not v.get("error") and v.get("layout")]
    gpus = plan.get("environment", {}).get("gpus") or []
    cpu = not gpus or {lay.get("device") for lay in layouts} == {"cpu"}
    procs = _joined([r.get("ngpu") for v in plan["variants"] for r in v.get("runs", [])])
    procs = str(plan.get("ngpu", "?")) if procs == "?" else procs
    steps = _joined([r.get("steps_run") for r in rows])  # a noise target may stop runs early
    steps = _joined([lay.get("steps") for lay in layouts]) if steps == "?" else steps
    flavor = _joined([lay.get("flavor") for lay in layouts])
    what = "process" if procs == "1" else "processes"
    device = "CPU" if cpu else gpus[0]
    return f"Ablation: {plan['spec']['name']} ({flavor}, {device}, {procs} {what}, {steps} steps)"


def side_by_side_note(plan: dict) -> str:
    """How the runs shared the machine (" " + a sentence), or "" when they ran one at a time."""
    n = plan.get("side_by_side", 1)
    if n <= 1:
        return ""
    if not plan.get("environment", {}).get("gpus"):
        return f" Runs ran side by side, up to {n} at a time, sharing this host's CPUs."
    return (
        f" Runs ran side by side, up to {n} at a time, each on its own GPUs of one node: they "
        "shared the host's CPUs, memory bandwidth and PCIe, so data loading and host-bound "
        "steps may be slower than alone."
    )


def render(plan: dict, rows: list[dict], plots: list[str], out: Path, noise: str) -> str:
    """report.md; noise: how the verdicts define noise (report.py says it once)."""
    spec = plan["spec"]
    lines = [f"# {title(plan, rows)}", ""]
    if spec["description"]:
        note = ""
        if any(value for value, _ in by_call(plan, "sets")):  # --set may change what it says
            note = " (the ablation file's description; `--set` changed the runs: the title says "
            note += "what ran)"
        lines += [spec["description"] + note, ""]
    lines += [
        f"{header(plan)} {plan['ngpu']} process(es) per run (GPUs column: a variant's own). "
        f"tokens/s = median over the logged steps after the first "
        f"{spec['throughput_warmup_steps']} (at most half of a run), the profiled steps left out, "
        "per GPU: trained tokens (the tokens the loss counts: no padding); processed tokens/s "
        "counts padding too. MFU: conventional (attention over the whole row, as published "
        "figures); in brackets the work done (attention within documents, causal). data %: "
        "time waiting for the data loader; compute / exposed comm / idle: the profiled steps "
        "(docs/ablation.md). Each verdict compares a variant with its baseline: the first "
        "variant unless the variant names one." + side_by_side_note(plan),
        "",
        "## Results",
        "",
        *results_table(rows),
        "",
        *([pipeline_columns.NOTE, ""] if pipeline_columns.header(rows)[0] else []),
        "## Verdicts",
        "",
        *[f"- {r['verdict']}" for r in rows],
        "",
        "Noise: " + noise,
        "",
        "Predicted GiB is the memory estimator's peak (estimation.py) for the program the run "
        "executes, compiled blocks included (docs/memory_estimation.md); measured is rank 0's "
        "active peak (the one the estimate models).",
        "",
    ]
    failed = [r for r in rows if r["error"]]
    if failed:
        lines += ["## Failed or invalid", ""]
        lines += [f"- {r['variant']}: {r['error']}" for r in failed] + [""]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots] + [""]
    else:
        lines += ["Plots: matplotlib is not installed (`pip install matplotlib`).", ""]
    notes = {r["variant"]: v["memory"]["note"] for r, v in zip(rows, plan["variants"])
             if v.get("memory", {}).get("note")}  # fmt: skip
    if notes:
        lines += ["Predicted memory: " + "; ".join(f"{k}: {v}" for k, v in notes.items()), ""]
    lines += ["## Commands", "", "```bash"]
    commands = by_call(plan, "command")
    for command, names in commands:  # a study in parts: each call's command, what it ran
        lines += [f"# ran {', '.join(names)}"] * (len(commands) > 1) + [shlex.join(command)]
    lines += [run["command"] for v in plan["variants"] for run in v.get("runs", [])]
    lines += ["```", "", "## Environment", ""]
    envs = by_call(plan, "environment")
    for env, names in envs:
        lines += [f"Variants {', '.join(names)}:", ""] * (len(envs) > 1) + environment_lines(env)
    return "\n".join(lines)


def environment_lines(env: dict) -> list[str]:
    gpus = ", ".join(env["gpus"]) or "none (CPU, gloo)"
    dirty = " (uncommitted changes)" if env["git_dirty"] else ""
    return [
        f"- git commit: `{env['git_commit']}`{dirty}",
        f"- torch {env['torch']}, CUDA {env['cuda']}, Python {env['python']}"
        + (f", torchao {env['torchao']}" if "torchao" in env else ""),
        f"- hardware: {env['cpu']} ({env['cpu_count']} logical CPUs); GPUs: {gpus}",
        f"- platform: {env['platform']}",
        "",
    ]
