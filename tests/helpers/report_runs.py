"""Hand-written ablation folders for the report's tests: run folders (metrics.jsonl, status.json,
config.toml) and the plan (ablation.json) that names them; no training."""

import json

from torchtitan_ablate.ablate.plan import PLAN_FILE

ENV = {"git_commit": "abc", "git_dirty": False, "python": "3", "torch": "2", "cuda": None}
ENV |= {"platform": "p", "cpu": "c", "cpu_count": 2, "gpus": []}


def make_run(
    out, variant, seed, tps, losses, status="ok", error=None, validation=None, packing=None
):
    run_dir = out / "runs" / variant / f"seed{seed}"
    run_dir.mkdir(parents=True)
    if packing:  # the trainer's config.toml, as far as the report reads it
        (run_dir / "config.toml").write_text(f'[training]\npacking = "{packing}"\n')
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


def plan(out, variants, sets=(), overrides=None, description=""):
    spec = {"name": "t", "description": description, "config_file": "c.toml",
            "throughput_warmup_steps": 1, "overrides": overrides or {}, "steps": None}  # fmt: skip
    doc = {"spec": spec, "command": ["ablate"], "ngpu": 1, "variants": variants, "environment": ENV}
    doc["sets"] = list(sets)
    (out / PLAN_FILE).write_text(json.dumps(doc))


def variant(name, runs, predicted=None, error=None, **layout_values):
    layout = {"global_batch_size": 4, "grad_accum": 1, "tokens_per_step": 256, "steps": 4}
    layout |= {"flavor": "0.6B", "seq_len": 64, **layout_values}
    memory = {"predicted_peak_gib": predicted, "fits": None if predicted is None else True}
    return {"name": name, "group": name, "error": error, "layout": layout, "runs": runs,
            "memory": {**memory, "note": ""}}  # fmt: skip
