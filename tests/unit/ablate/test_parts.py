"""A study in parts (--resume --only over several calls, maybe with different --set): each
variant keeps the arguments, command line and machine of the call that ran it, and the report
says which call ran which variant."""

import importlib.util
import json
from pathlib import Path

from torchtitan_ablate.ablate import markdown, plan
from torchtitan_ablate.ablate.ablation_file import load_spec

STUDY = """
[ablation]
config_file = "train_configs/debug_model.toml"
ngpu = 1
steps = 2

[variants.a]
training.seq_len = 32

[variants.b]
training.seq_len = 64
"""


def _call(spec, path, out, sets, only, resume=True):
    argv = ["ablate", str(path), *(a for s in sets for a in ("--set", s))]
    made = plan.make_plan(spec, str(path), None, sets, argv, estimate=False)
    plan.write_plan(made, out, resume, only)
    return json.loads((out / plan.PLAN_FILE).read_text())


def _finish(out, plan, name):
    (variant,) = [v for v in plan["variants"] if v["name"] == name]
    for run in variant["runs"]:
        (out / run["dir"]).mkdir(parents=True, exist_ok=True)
        status = {"status": "ok", "command": run["command"]}
        (out / run["dir"] / "status.json").write_text(json.dumps(status))


def _variant(plan, name):
    return next(v for v in plan["variants"] if v["name"] == name)


def test_each_variant_keeps_the_call_that_ran_it(tmp_path):
    path = tmp_path / "study.toml"
    path.write_text(STUDY)
    spec, out = load_spec(path), tmp_path / "out"
    first = _call(spec, path, out, [], {"a"}, resume=False)
    _finish(out, first, "a")
    # Plans written before variants named their call: the plan-level values were that call's.
    for v in first["variants"]:
        del v["call"]
    (out / plan.PLAN_FILE).write_text(json.dumps(first))

    second = _call(spec, path, out, ["training.steps=3"], {"b"})
    a, b = _variant(second, "a"), _variant(second, "b")
    assert a["runs"] == first["variants"][0]["runs"] and a["layout"]["steps"] == 2
    assert a["call"]["sets"] == [] and a["call"]["command"] == ["ablate", str(path)]
    assert "--training.steps=3" in b["runs"][0]["command"] and b["layout"]["steps"] == 3
    assert b["call"]["sets"] == ["training.steps=3"]

    head = markdown.header(second)
    assert "a: none; b: `training.steps=3`" in head and "2/3 steps" in head
    assert [names for _, names in markdown.by_call(second, "command")] == [["a"], ["b"]]
    assert [names for _, names in markdown.by_call(second, "environment")] == [["a", "b"]]

    # All variants again with the first call's arguments: a finished with them and keeps its
    # entry; b finished with other arguments, so it runs again and takes this call's entry.
    _finish(out, second, "b")
    third = _call(spec, path, out, [], None)
    assert _variant(third, "a") == a
    assert _variant(third, "b")["call"]["sets"] == [] and "steps=3" not in str(
        _variant(third, "b")["runs"]
    )


def test_one_call_reads_as_before(tmp_path):
    path = tmp_path / "study.toml"
    path.write_text(STUDY)
    plan = _call(load_spec(path), path, tmp_path / "out", ["training.steps=3"], None, False)
    head = markdown.header(plan)
    assert "Command-line overrides (`--set`, over the recipe and the ablation file): " in head
    assert "`training.steps=3`." in head and "; " not in head.split("overrides")[-1]
    assert len(markdown.by_call(plan, "command")) == 1


def test_resume_over_a_damaged_plan_is_one_line_and_keeps_it(tmp_path, capsys):
    root = Path(__file__).resolve().parents[3]
    spec = importlib.util.spec_from_file_location("ablate_cli", root / "scripts" / "ablate.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    path, out = tmp_path / "study.toml", tmp_path / "out"
    path.write_text(STUDY)
    out.mkdir()
    (out / plan.PLAN_FILE).write_text('{"variants": [')
    assert cli.main([str(path), "--out", str(out), "--resume", "--no-estimate"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("ablation error: ") and "cannot read the ablation plan" in line
    assert "move it aside or rerun without --resume" in line
    assert (out / plan.PLAN_FILE).read_text() == '{"variants": ['
