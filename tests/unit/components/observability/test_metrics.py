"""MetricsLogger's progress fields and console line, and the Weights & Biases tracker."""

import importlib.util
import json
import logging
import sys
import types

import pytest
import torch

from torchtitan_ablate.components.observability import metrics as metrics_mod
from torchtitan_ablate.components.observability import trackers
from torchtitan_ablate.components.observability.metrics import MetricsLogger, _hms
from torchtitan_ablate.config import ConfigError
from torchtitan_ablate.config.job_config import Metrics

VALUES = {"loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_seen": 512}


def _logger(tmp_path, config: Metrics | None = None, **kwargs) -> MetricsLogger:
    return MetricsLogger(
        config or Metrics(), str(tmp_path), torch.device("cpu"), 1e6, True, **kwargs
    )


def test_hms():
    assert _hms(0) == "0:00:00" and _hms(3725.9) == "1:02:05" and _hms(90000) == "25:00:00"


def test_eta_from_the_median_step_time_and_cpu_na(tmp_path, monkeypatch, caplog):
    now = [0.0]
    monkeypatch.setattr(metrics_mod.time, "perf_counter", lambda: now[0])
    m = _logger(tmp_path)
    m.open(resumed_step=0, last_step=10)
    for now[0] in (1.0, 2.0, 12.0, 13.0):  # steps take 1, 1, 10 (a save), 1 s: median 1
        m.add_tokens(256, 0.0, 0)
        m.add_trained(256)
    with caplog.at_level(logging.INFO, logger="torchtitan_ablate"):
        record = m.log(4, dict(VALUES))
    line = caplog.records[-1].getMessage()
    assert line.startswith("step     4/10") and "mfu n/a" in line and "mem n/a" in line
    assert line.endswith("elapsed 0:00:13  eta 0:00:06")  # 6 steps left at 1 s each
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["tokens_seen"] == 512 and isinstance(row["time"], float) and row == record
    # Where the console says n/a, the file says null (not a 0 that reads as a measurement).
    assert row["mfu"] is None and row["mfu_doc"] is None
    na = ("memory_max_active_gib", "memory_max_reserved_gib", "memory_max_reserved_pct")
    assert all(k in row and row[k] is None for k in na)
    assert all(row[k] is not None for k in row if k not in (*na, "mfu", "mfu_doc"))


def test_summary_line_names_loss_tokens_time_and_outputs(tmp_path, monkeypatch, caplog):
    now = [0.0]
    monkeypatch.setattr(metrics_mod.time, "perf_counter", lambda: now[0])
    m = _logger(tmp_path)
    m.open(resumed_step=0, last_step=2)
    with caplog.at_level(logging.INFO, logger="torchtitan_ablate"):
        m.log_summary(0, "ck", "none")  # a resumed run with nothing left to train
        for step, now[0] in ((1, 1.0), (2, 65.0)):
            m.add_tokens(256, 0.0, 0)
            m.add_trained(256)
            m.log(step, dict(VALUES, loss=3.0 - step))
        m.log_summary(1234567, str(tmp_path / "checkpoint"), "step-2")
    first, last = caplog.records[0].getMessage(), caplog.records[-1].getMessage()
    assert (
        first.startswith("run ended: no step trained, 0 tokens trained")
        and "checkpoint none" in first
    )
    assert last == (
        f"run ended: final loss 1.0000 (step 2), 1,234,567 tokens trained, wall time 0:01:05; "
        f"outputs in {tmp_path}: metrics {tmp_path / 'metrics.jsonl'}, last checkpoint "
        f"{tmp_path / 'checkpoint' / 'step-2'}"
    )
    quiet = MetricsLogger(Metrics(), str(tmp_path / "r1"), torch.device("cpu"), 1e6, False)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="torchtitan_ablate"):
        quiet.log_summary(5, "ck", "none")  # not rank 0
    assert not caplog.records


def test_known_peak_prints_mfu(tmp_path, caplog):
    m = _logger(tmp_path, Metrics(peak_tflops=100.0))
    m.open(resumed_step=0)  # no last step: no "/N" and no ETA
    m.add_tokens(256, 0.0, 0)
    m.add_trained(256)
    with caplog.at_level(logging.INFO, logger="torchtitan_ablate"):
        m.log(1, dict(VALUES))
    line = caplog.records[-1].getMessage()
    assert line.startswith("step     1  ") and "% " in line.split("mfu ")[1] and "eta" not in line


def test_dpo_rewards_and_their_validation_figures_are_on_the_console_line(tmp_path, caplog):
    rewards = {"rewards/chosen": 0.25, "rewards/rejected": -0.125, "rewards/margins": 0.375}
    rewards["rewards/accuracies"] = 0.75
    held_out = {f"validation_{k}": v / 2 for k, v in rewards.items()}
    m = _logger(tmp_path)
    m.open(resumed_step=0)
    with caplog.at_level(logging.INFO, logger="torchtitan_ablate"):
        m.log(1, dict(VALUES))
        m.log(2, {**VALUES, **rewards})
        m.log(3, {**VALUES, **rewards, "validation_loss": 0.5, **held_out})
    plain, train, both = (r.getMessage() for r in caplog.records[-3:])
    assert "rewards" not in plain
    expected = "rewards chosen/rejected 0.250/-0.125  margin 0.375  acc 0.75"
    assert expected in train and "val_" not in train
    assert f"  {expected}" in both
    assert (
        "val_loss 0.5000  val_rewards chosen/rejected 0.125/-0.062  margin 0.188  acc 0.38" in both
    )


def test_enable_wandb_without_the_package_is_one_config_error(monkeypatch):
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None)
    trackers.check_trackers(Metrics())  # off: nothing to check
    with pytest.raises(ConfigError, match="pip install wandb"):
        trackers.check_trackers(Metrics(enable_wandb=True))


def test_wandb_tracker_logs_numbers_only(tmp_path, monkeypatch):
    calls = {}
    run = types.SimpleNamespace(
        log=lambda values, step: calls.setdefault("log", []).append((step, values)),
        finish=lambda: calls.setdefault("finished", True),
    )
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.setdefault("init", kwargs) and run
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = Metrics(enable_wandb=True, wandb_run_name="r", wandb_mode="offline")
    m = _logger(tmp_path / "job", config, run_config={"training": {"steps": 2}})
    m.open(resumed_step=0, last_step=2)
    m.add_tokens(256, 0.0, 0)
    m.add_trained(256)
    m.log(1, {**VALUES, "expert_load_max_over_mean": [1.0, 1.2], "flag": True})
    m.close()
    assert calls["init"]["name"] == "r" and calls["init"]["group"] is None
    assert calls["init"]["config"] == {"training": {"steps": 2}}
    assert calls["init"]["dir"] == str(tmp_path / "job") and calls["finished"]
    ((step, values),) = calls["log"]
    assert step == 1 and "tokens_seen" in values and "time" in values
    assert "expert_load_max_over_mean" not in values and "flag" not in values


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb not installed")
def test_real_wandb_offline_writes_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = Metrics(enable_wandb=True, wandb_mode="offline", wandb_tags=["t"])
    m = _logger(tmp_path / "job", config, run_config={"training": {"steps": 1}})
    m.open(resumed_step=0, last_step=1)
    m.add_tokens(256, 0.0, 0)
    m.add_trained(256)
    m.log(1, dict(VALUES))
    m.close()
    (run_dir,) = (tmp_path / "job" / "wandb").glob("offline-run-*")
    (record,) = run_dir.glob("run-*.wandb")  # the offline record `wandb sync` uploads
    data = record.read_bytes()  # protobuf: the history's keys appear as plain strings
    assert all(k.encode() in data for k in ("tokens_seen", "tps", "loss"))
    assert b"training" in data  # the config
