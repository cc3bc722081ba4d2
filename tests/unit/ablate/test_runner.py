"""The runner's progress (one line per logged step) and its scheduling: one run at a time, or
side by side on disjoint GPUs."""

import json
import shlex
import sys

import pytest

from torchtitan_ablate.ablate import plan, runner


def test_progress_prints_every_logged_step(tmp_path, capsys):
    # Three records land between two polls (and a half-written fourth): each gets its line.
    rows = "".join(json.dumps({"step": s, "loss": 1.0, "tps": 10.0}) + "\n" for s in (1, 2, 3))
    metrics = str(tmp_path / "metrics.jsonl")
    script = f"import time; open({metrics!r}, 'w').write({rows!r} + '{{\"step\": 4'); "
    script += "time.sleep(1.5)"
    cmd = shlex.join(["NGPU=1", "CONFIG_FILE=x", sys.executable, "-c", script])
    job = runner.Launched(cmd, tmp_path, "run", steps=4, timeout=0.0)
    job.proc.wait()
    assert job.poll(eta_rest=0.0) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("  run: step")]
    assert [x.split()[2] for x in lines] == ["1/4", "2/4", "3/4"]


_RECORDER = """
import json, os, sys, time
start = time.time()
time.sleep(1.2)
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"name": sys.argv[2], "ngpu": os.environ["NGPU"],
                        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
                        "start": start, "end": time.time()}) + "\\n")
"""


def _plan(tmp_path, ngpus: list[int]) -> dict:
    script = tmp_path / "recorder.py"
    script.write_text(_RECORDER)
    variants = []
    for i, n in enumerate(ngpus):
        cmd = [f"NGPU={n}", "CONFIG_FILE=x", sys.executable, str(script)]
        cmd += [str(tmp_path / "ran.jsonl"), f"v{i}"]
        run = {"seed": 0, "dir": f"runs/v{i}/seed0", "ngpu": n, "command": shlex.join(cmd)}
        variants.append({"name": f"v{i}", "error": None, "layout": {"steps": 1}, "runs": [run]})
    return {"ngpu": 1, "variants": variants}


def _ran(tmp_path) -> dict[str, dict]:
    lines = (tmp_path / "ran.jsonl").read_text().splitlines()
    return {r["name"]: r for r in map(json.loads, lines)}


def _overlap(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def test_side_by_side_runs_get_disjoint_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    # Three 1-GPU runs, then a 2-GPU run that must wait for two free GPUs, then a 1-GPU run
    # that queues behind it (plan order), and one wanting more GPUs than the node has.
    plan = _plan(tmp_path, [1, 1, 1, 2, 1, 8]) | {"side_by_side": 4}
    runner.run_all(plan, tmp_path, resume=False)
    ran = _ran(tmp_path)
    assert sorted(r["gpus"] for r in (ran["v0"], ran["v1"], ran["v2"])) == ["4", "5", "6"]
    assert _overlap(ran["v0"], ran["v2"]) and len(ran["v3"]["gpus"].split(",")) == 2
    for a in ran.values():  # runs in flight together never share a GPU
        for b in ran.values():
            if a is not b and _overlap(a, b) and a["gpus"] and b["gpus"]:
                assert not set(a["gpus"].split(",")) & set(b["gpus"].split(","))
    assert ran["v5"]["gpus"] == "4,5,6,7"  # alone, with what the runner sees
    assert not any(_overlap(ran["v5"], r) for r in ran.values() if r is not ran["v5"])
    status = json.loads((tmp_path / "runs/v3/seed0/status.json").read_text())
    assert status["status"] == "ok" and len(status["gpus"]) == 2


def test_one_at_a_time_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    runner.run_all(_plan(tmp_path, [1, 1]), tmp_path, resume=False)
    ran = _ran(tmp_path)
    assert not _overlap(ran["v0"], ran["v1"])
    assert ran["v0"]["gpus"] == ran["v1"]["gpus"] == "2,3"  # the runner's own, untouched


def test_resume_skips_runs_finished_in_a_moved_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    plan = _plan(tmp_path, [1, 1])
    runs = [v["runs"][0] for v in plan["variants"]]
    for run in runs:
        run["command"] += f" --job.dump_folder={tmp_path}/old/{run['dir']}"
    runner.run_all(plan, tmp_path, resume=False)
    (tmp_path / "ran.jsonl").unlink()
    # The folder was copied elsewhere (the dump paths change); v1 also changed an argument.
    for run in runs:
        run["command"] = run["command"].replace("/old/", "/new/")
    runs[1]["command"] += " --training.steps=2"
    capsys.readouterr()
    runner.run_all(plan, tmp_path, resume=True)
    out = capsys.readouterr().out
    assert "v0 seed 0: finished before, skipped (--resume)" in out
    assert "v1 seed 0: finished before with other arguments, run again" in out
    assert set(_ran(tmp_path)) == {"v1"}


def test_only_runs_the_named_variants(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    runner.run_all(_plan(tmp_path, [1, 1, 1]), tmp_path, resume=False, only={"v0", "v2"})
    assert set(_ran(tmp_path)) == {"v0", "v2"}
    assert not (tmp_path / "runs" / "v1").exists()


@pytest.mark.parametrize("n", [1, 2])
def test_side_by_side_note_in_report(n):
    from torchtitan_ablate.ablate.markdown import side_by_side_note

    note = side_by_side_note({"side_by_side": n, "environment": {"gpus": ["H200"] * 4}})
    assert ("up to 2 at a time" in note) == (n == 2) and (note == "") == (n == 1)
    if n == 2:
        assert "its own GPUs" in note
        cpu = side_by_side_note({"side_by_side": n, "environment": {"gpus": []}})
        assert "sharing this host's CPUs" in cpu


def test_wandb_runs_grouped_by_ablation_named_by_variant_and_seed():
    from torchtitan_ablate.ablate.ablation_file import AblationSpec, Variant

    spec = AblationSpec("abl", "train_configs/debug_model.toml", [Variant("v1", {})], seeds=[1, 2])
    off = plan.plan_variant(spec, spec.variants[0], 1, [], estimate=False)
    assert not any("wandb" in a for r in off["runs"] for a in r["args"])  # not enabled: none
    on = plan.plan_variant(spec, spec.variants[0], 1, ["metrics.enable_wandb=true"], False)
    assert [r["args"][-2:] for r in on["runs"]] == [
        ["--metrics.wandb_group=abl", f"--metrics.wandb_run_name=v1-seed{s}"] for s in (1, 2)
    ]


_RUNNER = """
import json, sys
from pathlib import Path
from torchtitan_ablate.ablate import runner
out = Path(sys.argv[1])
try:
    runner.run_all(json.loads((out / "plan.json").read_text()), out, resume=False)
except runner.Stopped:
    sys.exit(143)
"""

_SLEEPER = """
import os, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(60)
"""


def test_sigterm_stops_and_records_the_runs_in_flight(tmp_path):
    import os
    import signal
    import subprocess
    import time

    (tmp_path / "sleeper.py").write_text(_SLEEPER)
    pid_file = tmp_path / "child.pid"
    cmd = shlex.join(["NGPU=1", "CONFIG_FILE=x", sys.executable, str(tmp_path / "sleeper.py")])
    run = {"seed": 0, "dir": "runs/v0/seed0", "ngpu": 1, "command": f"{cmd} {pid_file}"}
    variant = {"name": "v0", "error": None, "layout": {"steps": 1}, "runs": [run]}
    (tmp_path / "plan.json").write_text(json.dumps({"ngpu": 1, "variants": [variant]}))
    runner_proc = subprocess.Popen([sys.executable, "-c", _RUNNER, str(tmp_path)])
    deadline = time.time() + 30
    while not (pid_file.is_file() and pid_file.read_text()) and time.time() < deadline:
        time.sleep(0.2)
    child = int(pid_file.read_text())
    runner_proc.send_signal(signal.SIGTERM)
    assert runner_proc.wait(timeout=30) == 143
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):  # the run was stopped, not left running
        os.kill(child, 0)
    status = json.loads((tmp_path / "runs/v0/seed0/status.json").read_text())
    assert (
        status["status"] == "failed"
        and "stopped: the ablation runner got SIGTERM" in (status["error"])
    )
