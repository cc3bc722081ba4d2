"""scripts/ablate.py end to end: every shipped ablation file validates (--dry-run), an unknown
key is named, and a small ablation (2 variants x 2 seeds x 2 steps on 2 gloo ranks) writes every
report file with real numbers; --resume skips finished runs and --report rebuilds."""

import csv
import importlib.util
import json
from pathlib import Path

import pytest

from torchtitan_ablate.ablate.cli import _study_command

ROOT = Path(__file__).resolve().parents[2]
ABLATIONS = sorted((ROOT / "train_configs" / "ablations").glob("*.toml"))
spec = importlib.util.spec_from_file_location("ablate_cli", ROOT / "scripts" / "ablate.py")
ablate_cli = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ablate_cli)

# Studies whose knob the engine does not have yet: --dry-run must name the variant and key.
NOT_YET: dict[str, str] = {}


def test_all_studies_shipped():
    names = {p.stem for p in ABLATIONS}
    assert names >= {
        "zero2_vs_zero3_vs_hsdp", "ep_vs_no_ep", "packing_vs_padding", "chunked_vs_plain_loss",
        "float8_vs_bf16", "ac_modes", "compile_on_off", "attention_backends", "batch_size_sweep",
        "tp_vs_fsdp", "pp_schedules",
    }  # fmt: skip


@pytest.mark.parametrize("path", ABLATIONS, ids=[p.stem for p in ABLATIONS])
def test_shipped_ablation_dry_run(path, capsys):
    rc = ablate_cli.main([str(path), "--dry-run", "--no-estimate"])
    out = capsys.readouterr().out
    if path.stem in NOT_YET:
        assert rc == 2 and f"error: {NOT_YET[path.stem]}" in out
    else:
        assert rc == 0, out
        assert "INVALID" not in out


def test_unknown_override_key_names_variant_and_key(tmp_path, capsys):
    path = tmp_path / "future.toml"
    path.write_text(
        '[ablation]\nconfig_file = "train_configs/debug_model.toml"\n'
        "[variants.plain]\n[variants.fused]\ntraining.fused_loss_kernel = true\n"
    )
    assert ablate_cli.main([str(path), "--dry-run", "--no-estimate"]) == 2
    out = capsys.readouterr().out
    assert "error: variant 'fused': unknown key 'training.fused_loss_kernel'" in out
    assert "plain " in out and out.count("INVALID") == 1  # the valid variant is still listed
    # Without --dry-run nothing runs unless --skip-invalid.
    assert ablate_cli.main([str(path), "--no-estimate", "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()
    # --only leaves the invalid variant out; a name that is no variant is one line.
    assert ablate_cli.main([str(path), "--dry-run", "--no-estimate", "--only", "plain"]) == 0
    capsys.readouterr()
    assert ablate_cli.main([str(path), "--dry-run", "--no-estimate", "--only", "plain,fuse"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ablation error: --only plain,fuse: no variant fuse; the variants: plain, fused"]


def test_report_command_is_the_whole_study(tmp_path):
    # A study run in parts (--resume --only ...) reports the command that runs all of it.
    argv = ["x.toml", "--resume", "--only", "a,b", "--only=c", "--set", "training.steps=3"]
    assert _study_command(argv) == ["x.toml", "--set", "training.steps=3"]


@pytest.mark.parametrize("sharding", ["documents", "rows"])
def test_plan_says_when_variants_train_on_different_rows(tmp_path, capsys, sharding):
    # CP 2 on 2 processes leaves dp 1; the other variant has dp 2.
    path = tmp_path / "cp.toml"
    path.write_text(
        '[ablation]\nconfig_file = "train_configs/debug_model.toml"\nngpu = 2\n'
        f'[overrides]\ntraining.data_sharding = "{sharding}"\n'
        "[variants.fsdp]\n[variants.cp2]\nparallelism.context_parallel_degree = 2\n"
    )
    assert ablate_cli.main([str(path), "--dry-run", "--no-estimate"]) == 0
    out = capsys.readouterr().out
    assert ("dp degrees differ (1, 2)" in out) == (sharding == "documents"), out


def test_unknown_set_key_is_an_error(capsys):
    path = ROOT / "train_configs" / "ablations" / "ac_modes.toml"
    rc = ablate_cli.main([str(path), "--dry-run", "--no-estimate", "--set", "training.stepz=3"])
    assert rc == 2 and "unknown key 'training.stepz'" in capsys.readouterr().out


def test_report_of_a_folder_without_a_plan_is_one_line(tmp_path, capsys):
    assert ablate_cli.main(["--report", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ablation error: ") and "ablation.json" in err[0]


@pytest.mark.parametrize(
    "option, message", [(["--ngpu", "0"], "--ngpu 0"), (["--timeout", "-5"], "--timeout -5")]
)
def test_bad_options_exit_2(option, message, capsys):
    with pytest.raises(SystemExit) as e:
        ablate_cli.main(["x.toml", *option])
    assert e.value.code == 2 and message in capsys.readouterr().err


ABLATION = """
[ablation]
config_file = "train_configs/debug_model.toml"
ngpu = 1
seeds = [1, 2]
steps = 2

[overrides]
training.seq_len = 32
training.local_batch_size = 2
lr_scheduler.warmup_steps = 1
metrics.log_freq = 1

[variants.no_ac]
activation_checkpoint.mode = "none"

[variants.full_ac]
activation_checkpoint.mode = "full"
"""


@pytest.mark.slow
def test_small_ablation_end_to_end(tmp_path, capsys):
    path = tmp_path / "tiny.toml"
    path.write_text(ABLATION)
    out = tmp_path / "out"
    assert ablate_cli.main([str(path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "[4/4] full_ac seed 2: done" in printed and "step 2/2" in printed
    for name in ("results.csv", "results.json", "report.md", "loss.png", "throughput.png"):
        assert (out / name).is_file(), name
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["variant"] for r in rows] == ["no_ac", "full_ac"]
    for r in rows:
        assert r["status"] == "ok" and r["runs_ok"] == "2"
        assert float(r["tps_median"]) > 0 and float(r["final_loss_mean"]) > 0
        assert r["final_loss_spread"] != ""  # two seeds
    assert float(rows[0]["speedup"]) == 1.0 and float(rows[1]["speedup"]) > 0
    # Recomputing activations is numerically the same program: equal losses per seed.
    assert rows[0]["final_loss_mean"] == rows[1]["final_loss_mean"]
    md = (out / "report.md").read_text()
    assert "full_ac vs no_ac:" in md and "NGPU=1 CONFIG_FILE=train_configs/debug_model.toml" in md

    # --resume: nothing left to run; --report: rebuilt from the run folders alone.
    (out / "report.md").unlink()
    assert ablate_cli.main([str(path), "--out", str(out), "--resume", "--no-estimate"]) == 0
    assert capsys.readouterr().out.count("skipped (--resume)") == 4
    (out / "results.json").unlink()
    assert ablate_cli.main(["--report", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert [r["variant"] for r in doc["rows"]] == ["no_ac", "full_ac"]


def test_side_by_side_with_different_gpu_counts_is_noted(capsys):
    path = "train_configs/ablations/fsdp_weak_scaling.toml"
    args = [path, "--dry-run", "--no-estimate", "--side-by-side", "4"]
    assert ablate_cli.main(args) == 0
    assert "note: the variants run on [1, 2, 4] GPUs; side by side" in capsys.readouterr().out
    assert ablate_cli.main([path, "--dry-run", "--no-estimate"]) == 0
    assert "side by side" not in capsys.readouterr().out


def test_report_estimate_fills_predictions_skipped_at_planning(tmp_path, capsys):
    from torchtitan_ablate.ablate import plan as ablation_plan
    from torchtitan_ablate.ablate.ablation_file import load_spec

    path = tmp_path / "tiny.toml"
    path.write_text(ABLATION)
    spec = load_spec(path)
    out = tmp_path / "out"
    planned = ablation_plan.make_plan(spec, str(path), None, [], ["ablate"], estimate=True)
    ablation_plan.write_plan(
        ablation_plan.make_plan(spec, str(path), None, [], ["ablate"], False), out
    )
    sets = ["--set", "memory_estimation.device_memory_gib=40"]
    assert ablate_cli.main(["--report", str(out), "--estimate", *sets]) == 0
    assert "predicted the memory of 2 variant(s)" in capsys.readouterr().out
    plan = json.loads((out / ablation_plan.PLAN_FILE).read_text())
    for before, after in zip(planned["variants"], plan["variants"]):
        mem = after["memory"]
        assert mem["predicted_peak_gib"] == before["memory"]["predicted_peak_gib"]
        assert mem["device_memory_gib"] == 40 and "after the runs" in mem["note"]
    assert "after the runs" in (out / "report.md").read_text()
    assert ablate_cli.main(["--report", str(out), "--estimate"]) == 0  # nothing left to do
    assert "predicted the memory of 0 variant(s)" in capsys.readouterr().out


def test_estimate_needs_report(capsys):
    with pytest.raises(SystemExit) as e:
        ablate_cli.main(["train_configs/ablations/liger_vs_cce.toml", "--estimate"])
    assert e.value.code == 2 and "--estimate goes with --report" in capsys.readouterr().err
