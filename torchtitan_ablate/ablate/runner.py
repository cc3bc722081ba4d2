"""Plan an ablation (validate every variant, predict its memory), then run variant x seed one
after another through ./run_train.sh, each into OUT/runs/<variant>/seed<N>/.

OUT/ablation.json holds the plan (resolved arguments, layouts, predictions, commands, versions);
each run folder gets train.log, the trainer's metrics.jsonl and config.toml, and status.json
(ok / failed with its error line). The report is built from these files only (report.py).
"""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from torchtitan_ablate.ablate.environment import ROOT, environment
from torchtitan_ablate.ablate.spec import AblationSpec, Variant
from torchtitan_ablate.config import ConfigError, JobConfig, load_config

PLAN_FILE = "ablation.json"


def predict_memory(config: JobConfig, ngpu: int) -> dict[str, Any]:
    """The memory estimator's per-GPU peak and the verdict estimation.py gives, or "n/a" with
    the reason when the estimator cannot model this config."""
    from torchtitan_ablate import memory
    from torchtitan_ablate.memory.report import device_memory_gib, verdict

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


def check_layout(config: JobConfig, ngpu: int) -> dict[str, Any]:
    """The checks the trainer makes before building anything: mesh, model, batch."""
    from torchtitan_ablate.build import check_layout as build_check_layout

    layout = build_check_layout(config, ngpu)
    pd, grad_accum = layout.parallel_dims, layout.grad_accum
    global_batch = layout.sequences_per_step
    return {
        "flavor": config.model.flavor,
        "ngpu": ngpu,
        "mesh": f"rep{pd.dp_replicate} shard{pd.dp_shard} cp{pd.cp} ep{pd.ep}",
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
    entry.update(description=variant.description, overrides=variant.overrides, error=None)
    try:
        config = load_config(["--job.config_file", spec.config_file, *args])
        entry["layout"] = check_layout(config, ngpu)
    except ConfigError as e:
        entry["error"] = f"variant {variant.name!r}: {e}".replace("command line: ", "")
        return entry
    seeds = spec.seeds or [entry["layout"]["seed"]]
    entry["seeds"] = seeds
    entry["memory"] = (
        predict_memory(config, ngpu)
        if estimate
        else {"predicted_peak_gib": None, "fits": None, "note": "n/a: --no-estimate"}
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
    return {
        "spec": asdict(spec),
        "ablation_file": ablation_file,
        "command": argv,
        "ngpu": ngpu,
        "sets": sets,
        "variants": [plan_variant(spec, v, ngpu, sets, estimate) for v in spec.variants],
        "environment": environment(),
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


def write_plan(plan: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for v in plan["variants"]:
        for run in v.get("runs", []):
            run["command"] = shlex.join(run_command(plan, run, out))
    (out / PLAN_FILE).write_text(json.dumps(plan, indent=1) + "\n")


def read_status(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "status.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ERROR_LINE = re.compile(r"([A-Za-z_.]*(Error|Exception)\b|config error|out of memory)")


def error_line(log: Path, returncode: int) -> str:
    """The last informative error line of a failed run's log."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    hits = [
        x.strip()
        for x in lines
        if ERROR_LINE.search(x) and "ChildFailedError" not in x and "Traceback" not in x
    ]
    if hits:
        return hits[-1][:500]
    if returncode < 0 or returncode == 137:
        return f"killed by signal {-returncode if returncode < 0 else 9} (out of host memory?)"
    tail = [x.strip() for x in lines if x.strip()]
    return (tail[-1] if tail else "no output")[:500] + f" (exit code {returncode})"


def _new_records(metrics: Path, after_step: int) -> list[dict]:
    """The complete records logged after `after_step` (the last line may be half-written)."""
    if not metrics.is_file():
        return []
    records = []
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            break
        if rec["step"] > after_step:
            records.append(rec)
    return records


def _fmt_s(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def launch(cmd: list[str], run_dir: Path, label: str, steps: int, eta_rest: float, timeout: float):
    """Runs one training, printing a progress line per logged step; returns (rc, wall_s)."""
    env = dict(os.environ, MASTER_PORT=str(_free_port()))
    env.update(a.split("=", 1) for a in cmd[:2])
    start = time.perf_counter()
    with open(run_dir / "train.log", "w") as log:
        proc = subprocess.Popen(
            cmd[2:], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        last_step, first = 0, None  # first logged (step, time): the ETA leaves start-up out
        try:
            while proc.poll() is None:
                time.sleep(1.0)
                elapsed = time.perf_counter() - start
                if timeout and elapsed > timeout:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait()
                    log.write(f"\nablate: run exceeded --timeout {timeout:.0f} s; stopped\n")
                    break
                for rec in _new_records(run_dir / "metrics.jsonl", last_step):
                    last_step = rec["step"]
                    first = first or (last_step, elapsed)
                    done, took = last_step - first[0], elapsed - first[1]
                    per_step = took / done if done else elapsed / last_step
                    left = per_step * (steps - last_step)
                    print(
                        f"  {label}: step {last_step}/{steps}  loss {rec['loss']:.4f}  "
                        f"tps {rec['tps']:,.0f}  elapsed {_fmt_s(elapsed)}  ETA run "
                        f"{_fmt_s(left)}, all {_fmt_s(left + eta_rest)}",
                        flush=True,
                    )
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
    return proc.returncode, time.perf_counter() - start


def run_all(plan: dict, out: Path, resume: bool, timeout: float = 0.0) -> None:
    """Runs every valid variant x seed; a failed run is recorded and the rest go on."""
    todo = [(v, r) for v in plan["variants"] if not v["error"] for r in v["runs"]]
    walls: list[float] = []
    for i, (variant, run) in enumerate(todo, 1):
        run_dir = out / run["dir"]
        label = f"[{i}/{len(todo)}] {variant['name']} seed {run['seed']}"
        status = read_status(run_dir)
        if resume and status and status["status"] == "ok" and status["command"] == run["command"]:
            print(f"{label}: finished before, skipped (--resume)", flush=True)
            continue
        if run_dir.exists():  # metrics.jsonl appends and checkpoints resume: start clean
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        mean_wall = sum(walls) / len(walls) if walls else 0.0
        print(f"{label}: {run['command']}", flush=True)
        rc, wall = launch(
            run_command(plan, run, out),
            run_dir,
            label,
            variant["layout"]["steps"],
            mean_wall * (len(todo) - i),
            timeout,
        )
        walls.append(wall)
        status = {"status": "ok" if rc == 0 else "failed", "returncode": rc, "wall_s": wall}
        status.update(command=run["command"], finished=time.strftime("%Y-%m-%d %H:%M:%S"))
        if rc != 0:
            status["error"] = error_line(run_dir / "train.log", rc)
            print(f"{label}: FAILED in {_fmt_s(wall)}: {status['error']}", flush=True)
        else:
            print(f"{label}: done in {_fmt_s(wall)}", flush=True)
        (run_dir / "status.json").write_text(json.dumps(status, indent=1) + "\n")
