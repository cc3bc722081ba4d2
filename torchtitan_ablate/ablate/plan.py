"""Plan an ablation (validate every variant, predict its memory) and write it down; runner.py
runs variant x seed through ./run_train.sh, each into OUT/runs/<variant>/seed<N>/.

OUT/ablation.json holds the plan (resolved arguments, layouts, predictions, commands, versions);
each run folder gets train.log, the trainer's metrics.jsonl and config.toml, and status.json
(ok / failed with its error line). The report is built from these files only (report.py).
"""

import json
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Any

from torchtitan_ablate.ablate.ablation_file import AblationError, AblationSpec, Variant
from torchtitan_ablate.ablate.environment import environment
from torchtitan_ablate.config import ConfigError, JobConfig, load_config

PLAN_FILE = "ablation.json"
NOT_ESTIMATED = "n/a: --no-estimate"


def predict_memory(config: JobConfig, ngpu: int) -> dict[str, Any]:
    """The memory estimator's per-GPU peak and the verdict estimation.py gives, or "n/a" with
    the reason when the estimator cannot model this config."""
    from torchtitan_ablate import estimator as memory
    from torchtitan_ablate.estimator.verdict import device_memory_gib, verdict

    config.memory_estimation.world_size = ngpu
    try:
        est = memory.estimate(config)
    except ConfigError as e:  # anything else is an estimator bug: let it surface
        reason = (str(e).splitlines() or ["ConfigError"])[0]
        return {"predicted_peak_gib": None, "fits": None, "note": f"n/a: {reason}"}
    device = device_memory_gib(config)
    fits, _ = verdict(est, device)
    return {
        "predicted_peak_gib": est["peak_gib"],
        "fits": fits,
        "device_memory_gib": device,
        "note": "",
    }


def plan_layout(config: JobConfig, ngpu: int) -> dict[str, Any]:
    """The checks the trainer makes before building anything: mesh, model, batch; and the steps
    training.epochs comes to (the data counted as the trainer counts it)."""
    from torchtitan_ablate.build import check_layout, resolve_steps

    layout = check_layout(config, ngpu)
    config = resolve_steps(config, layout)
    pd, grad_accum = layout.parallel_dims, layout.grad_accum
    global_batch = layout.sequences_per_step
    return {
        "flavor": config.model.flavor,
        "device": config.training.device,
        "ngpu": ngpu,
        "mesh": f"rep{pd.dp_replicate} shard{pd.dp_shard} cp{pd.cp} ep{pd.ep} tp{pd.tp} pp{pd.pp}",
        "dp": pd.dp,
        "grad_accum": grad_accum,
        "local_batch_size": config.training.local_batch_size,
        "global_batch_size": global_batch,
        "seq_len": config.training.seq_len,
        "tokens_per_step": global_batch * config.training.seq_len,
        "steps": config.training.steps,
        "seed": config.training.seed,
        # Runs of one seed and model size start from the same weights in every layout and
        # variant (models/common/init.py) unless they load a checkpoint: which one, if any.
        "initial_weights": config.checkpoint.initial_load_path or "seed",
        "data_sharding": config.training.data_sharding,
    }


def data_note(variants: list[dict[str, Any]]) -> str:
    """Why variants would see different data ("" when they see the same rows per step)."""
    layouts = [v["layout"] for v in variants if not v.get("error")]
    dps = sorted({lay["dp"] for lay in layouts})
    if len(dps) < 2 or all(lay["data_sharding"] == "rows" for lay in layouts):
        return ""
    return (
        f"data: the variants' dp degrees differ ({', '.join(map(str, dps))}) and documents are "
        "sharded per dp rank, so they train on different rows; add training.data_sharding = "
        '"rows" to [overrides] to compare them on identical global batches'
    )


def plan_variant(
    spec: AblationSpec, variant: Variant, ngpu: int, sets: list[str], estimate: bool
) -> dict[str, Any]:
    """Validates one variant exactly as the launcher will load it, at its own ngpu where it
    has one; never raises."""
    ngpu = variant.ngpu or ngpu
    seed = spec.seeds[0] if spec.seeds else None
    args = spec.run_args(variant, seed, sets)
    entry: dict[str, Any] = {"name": variant.name, "group": variant.group or variant.name}
    entry["baseline"] = variant.baseline or spec.variants[0].name
    entry.update(description=variant.description, overrides=variant.overrides, error=None)
    try:
        config = load_config(["--job.config_file", spec.config_file, *args])
        entry["layout"] = plan_layout(config, ngpu)
    except ConfigError as e:
        entry["error"] = f"variant {variant.name!r}: {e}".replace("command line: ", "")
        return entry
    seeds = spec.seeds or [entry["layout"]["seed"]]
    entry["seeds"] = seeds
    entry["memory"] = (
        predict_memory(config, ngpu)
        if estimate
        else {"predicted_peak_gib": None, "fits": None, "note": NOT_ESTIMATED}
    )
    entry["runs"] = []
    for s in seeds:
        run_dir = f"runs/{variant.name}/seed{s}"
        run_args = spec.run_args(variant, s if spec.seeds else None, sets)
        if config.metrics.enable_wandb:  # one W&B group per ablation, a run per variant x seed
            if not config.metrics.wandb_group:  # a group the user set is kept
                run_args.append(f"--metrics.wandb_group={spec.name}")
            run_args.append(f"--metrics.wandb_run_name={variant.name}-seed{s}")
        entry["runs"].append({"seed": s, "dir": run_dir, "args": run_args, "ngpu": ngpu})
    return entry


def make_plan(
    spec: AblationSpec,
    ablation_file: str,
    ngpu: int | None,
    sets: list[str],
    argv: list[str],
    estimate: bool = True,
) -> dict[str, Any]:
    ngpu = spec.ngpu if ngpu is None else ngpu
    call = {"command": argv, "sets": sets, "environment": environment()}
    variants = [plan_variant(spec, v, ngpu, sets, estimate) for v in spec.variants]
    for entry in variants:  # the call that runs it: a study in parts keeps each one's own
        entry["call"] = call
    return {
        "spec": asdict(spec),
        "ablation_file": ablation_file,
        "command": argv,
        "ngpu": ngpu,
        "sets": sets,
        "variants": variants,
        "environment": call["environment"],
    }


def run_command(plan: dict, run: dict, out: Path) -> list[str]:
    """The exact launcher command of one run (as a shell line: env assignments first)."""
    dump = out / run["dir"]
    cfg = plan["spec"]["config_file"]
    return [
        f"NGPU={run.get('ngpu', plan['ngpu'])}",
        f"CONFIG_FILE={cfg}",
        "./run_train.sh",
        *run["args"],
        f"--job.dump_folder={dump}",
    ]


def write_plan(plan: dict, out: Path, resume: bool = False, only: set[str] | None = None) -> None:
    """Writes OUT/ablation.json. resume: a study in parts; the variants this call does not run
    (left out by only, or finished before with the same commands) keep the entry of the call
    that ran them, so the report gives each run its own arguments, command line and machine."""
    out.mkdir(parents=True, exist_ok=True)
    for v in plan["variants"]:
        for run in v.get("runs", []):
            run["command"] = shlex.join(run_command(plan, run, out))
    if resume and (out / PLAN_FILE).is_file():
        _keep_earlier_calls(plan, read_plan(out), out, only)
    _save_plan(plan, out)


def read_plan(out: Path) -> dict:
    """OUT/ablation.json; an AblationError when out is not an ablation's output folder."""
    path = out / PLAN_FILE
    if not path.is_file():
        raise AblationError(f"{path} not found: give the --out folder of an ablation run")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AblationError(f"{path}: cannot read the ablation plan: {e}") from None


def _keep_earlier_calls(plan: dict, earlier: dict, out: Path, only: set[str] | None) -> None:
    # An entry that names no call of its own takes the plan-level values: one call ran them all.
    call = {k: earlier.get(k) for k in ("command", "sets", "environment")}
    kept = {v["name"]: v for v in earlier["variants"] if not v.get("error")}
    for i, v in enumerate(plan["variants"]):
        old = kept.get(v["name"])
        if old is None or v["error"]:
            continue
        finished = all(finished_before(read_status(out / r["dir"]), r) for r in v["runs"])
        if (only is not None and v["name"] not in only) or finished:
            old.setdefault("call", call)
            plan["variants"][i] = old


def _save_plan(plan: dict, out: Path) -> None:
    (out / PLAN_FILE).write_text(json.dumps(plan, indent=1) + "\n")


def finished_before(status: dict[str, Any] | None, run: dict) -> bool:
    """The run's status.json says it finished ok with the same command but for where it
    writes: a study folder copied or moved (or reached by another path) keeps its finished runs
    under --resume."""

    def key(command: str) -> list[str]:
        return [t for t in shlex.split(command) if not t.startswith("--job.dump_folder=")]

    ok = status is not None and status["status"] == "ok"
    return ok and key(status["command"]) == key(run["command"])


def read_status(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "status.json"
    return json.loads(path.read_text()) if path.is_file() else None


def fill_predictions(out: Path, plan: dict, sets: list[str]) -> int:
    """Predicts the memory of the variants planned with --no-estimate (e.g. to spend no GPU
    time on it) from their runs' arguments, on any machine, and writes the plan back; the
    note says the prediction came after the runs. sets: extra overrides (e.g. the device
    memory for the fits verdict). Returns how many variants were predicted."""
    done = 0
    for v in plan["variants"]:
        if v["error"] or v.get("memory", {}).get("note") != NOT_ESTIMATED:
            continue
        run = v["runs"][0]
        args = ["--job.config_file", plan["spec"]["config_file"], *run["args"]]
        config = load_config(args + [f"--{s}" for s in sets])
        v["memory"] = predict_memory(config, run["ngpu"])
        if v["memory"]["predicted_peak_gib"] is not None:
            v["memory"]["note"] = "predicted after the runs (--report --estimate)"
        done += 1
    _save_plan(plan, out)
    return done
