"""The runner's progress: one line per logged step, however many land between two polls."""

import json
import sys

from torchtitan_ablate.ablate import runner


def test_launch_prints_every_logged_step(tmp_path, capsys):
    # Three records land between two polls (and a half-written fourth): each gets its line.
    rows = "".join(json.dumps({"step": s, "loss": 1.0, "tps": 10.0}) + "\n" for s in (1, 2, 3))
    metrics = str(tmp_path / "metrics.jsonl")
    script = f"import time; open({metrics!r}, 'w').write({rows!r} + '{{\"step\": 4'); "
    script += "time.sleep(1.5)"
    cmd = ["NGPU=1", "CONFIG_FILE=x", sys.executable, "-c", script]
    rc, _ = runner.launch(cmd, tmp_path, "run", steps=4, eta_rest=0.0, timeout=0.0)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("  run: step")]
    assert rc == 0 and [x.split()[2] for x in lines] == ["1/4", "2/4", "3/4"]


def test_wandb_runs_grouped_by_ablation_named_by_variant_and_seed():
    from torchtitan_ablate.ablate.spec import AblationSpec, Variant

    spec = AblationSpec("abl", "train_configs/debug_model.toml", [Variant("v1", {})], seeds=[1, 2])
    off = runner.plan_variant(spec, spec.variants[0], 1, [], estimate=False)
    assert not any("wandb" in a for r in off["runs"] for a in r["args"])  # not enabled: none
    on = runner.plan_variant(spec, spec.variants[0], 1, ["metrics.enable_wandb=true"], False)
    assert [r["args"][-2:] for r in on["runs"]] == [
        ["--metrics.wandb_group=abl", f"--metrics.wandb_run_name=v1-seed{s}"] for s in (1, 2)
    ]
