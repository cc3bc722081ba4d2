"""End-to-end single-process training on CPU: loss falls, exact resume, accumulation."""

import json
import os
import signal

import pytest

from tests.helpers.training import run
from torchtitan_ablate import train
from torchtitan_ablate.config import load_config


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_loss_falls_and_metrics_written(tmp_path, flavor):
    records = run(tmp_path, "--model.flavor", flavor, "--training.steps", "25")
    assert records[-1]["loss"] < 0.8 * records[0]["loss"]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 26))
    keys = {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "data_time_frac"}
    keys |= {"memory_max_active_gib", "memory_max_reserved_gib"}
    if flavor == "debugmodel_moe":
        keys |= {"moe_aux_loss", "expert_load_imbalance"}
        assert lines[0]["moe_aux_loss"] > 0 and lines[0]["expert_load_imbalance"] >= 1.0
    assert keys <= set(lines[0])
    written = load_config(["--job.config_file", str(tmp_path / "config.toml")])
    assert written.model.flavor == flavor and written.training.steps == 25  # the resolved run


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_exact_resume_after_exit_at_step(tmp_path, flavor):
    common = ["--model.flavor", flavor, "--training.steps", "6", "--checkpoint.enable"]
    common += ["--validation.enable", "--validation.dataset_path", "assets/data/debug_corpus.jsonl"]
    common += ["--validation.freq", "2", "--validation.steps", "2"]
    full = run(tmp_path / "full", *common)
    first = run(tmp_path / "split", *common, "--training.exit_at_step", "3")
    assert [r["step"] for r in first] == [1, 2, 3]
    rest = run(tmp_path / "split", *common)
    assert [r["step"] for r in rest] == [4, 5, 6]
    for key in ("loss", "lr", "validation_loss"):  # validated at steps 2, 4 and 6
        assert [r.get(key) for r in first + rest] == [r.get(key) for r in full], key
    assert sum("validation_loss" in r for r in full) == 3


def test_sigterm_saves_and_resumes_exactly(tmp_path, monkeypatch):
    common = ["--training.steps", "5", "--checkpoint.enable"]
    full = run(tmp_path / "full", *common)
    real_step = train.Trainer.train_step

    def step_then_preempt(self, batches):
        out = real_step(self, batches)
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(train.Trainer, "train_step", step_then_preempt)
    first = run(tmp_path / "split", *common)
    monkeypatch.undo()
    assert [r["step"] for r in first] == [1, 2]
    assert (tmp_path / "split" / "checkpoint" / "step-2" / ".metadata").is_file()
    rest = run(tmp_path / "split", *common)
    assert [r["loss"] for r in first + rest] == [r["loss"] for r in full]


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    big = run(tmp_path / "big", "--training.steps", "3", "--training.local_batch_size", "8")
    acc = run(
        tmp_path / "acc",
        "--training.steps",
        "3",
        "--training.local_batch_size",
        "4",
        "--training.global_batch_size",
        "8",
    )
    for a, b in zip(big, acc):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_bad_global_batch_is_a_config_error(tmp_path):
    with pytest.raises(SystemExit) as e:
        from torchtitan_ablate.config import run_main

        run_main(
            train.main,
            ["--job.dump_folder", str(tmp_path), "--training.global_batch_size", "12"],
        )
    assert e.value.code == 2


def test_moe_aux_loss_with_full_ac_trains_like_no_ac(tmp_path):
    """The aux-loss gradient rides on each MoE output, so recomputation under full AC gives the
    same training as no AC (and no longer recomputes all layers at once)."""
    common = ["--model.flavor", "debugmodel_moe", "--training.steps", "4"]
    plain = run(tmp_path / "plain", *common)
    ac = run(tmp_path / "ac", *common, "--activation_checkpoint.mode", "full")
    assert plain[0]["moe_aux_loss"] > 0
    for a, b in zip(plain, ac):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["moe_aux_loss"] == pytest.approx(b["moe_aux_loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


def test_profiler_writes_a_trace_every_profile_freq_steps(tmp_path):
    run(
        tmp_path,
        "--training.steps",
        "4",
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "2",
    )
    traces = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*_trace.json"))
    assert traces == [
        "profile_traces/iteration_2/rank0_trace.json",
        "profile_traces/iteration_4/rank0_trace.json",
    ]
    assert json.loads((tmp_path / traces[0]).read_text())["traceEvents"]
