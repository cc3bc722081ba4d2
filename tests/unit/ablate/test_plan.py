"""The plan's memory prediction: the estimator's peak and estimation.py's verdict, "n/a" with
the reason only for configs the estimator cannot model (ConfigError), never for its bugs."""

import pytest

import torchtitan_ablate.estimator
from torchtitan_ablate.ablate.plan import predict_memory
from torchtitan_ablate.config import ConfigError, load_config


def config(device_gib: float):
    args = ["--job.config_file", "train_configs/debug_model.toml"]
    return load_config(args + ["--memory_estimation.device_memory_gib", str(device_gib)])


def fake_estimate(config):
    assert config.memory_estimation.world_size == 4  # the plan's ngpu
    return {"peak_gib": 9.0, "context_gib": 1.5}


@pytest.mark.parametrize("device_gib, fits", [(12.0, True), (10.0, False)])
def test_verdict_counts_the_context_like_estimation_py(monkeypatch, device_gib, fits):
    monkeypatch.setattr(torchtitan_ablate.estimator, "estimate", fake_estimate)
    memory = predict_memory(config(device_gib), 4)
    assert memory == {
        "predicted_peak_gib": 9.0, "fits": fits, "device_memory_gib": device_gib, "note": ""
    }  # fmt: skip


def test_config_the_estimator_cannot_model_is_na_with_reason(monkeypatch):
    def refuse(config):
        raise ConfigError("parallelism.fsdp_cpu_offload = true is not supported\nmore")

    monkeypatch.setattr(torchtitan_ablate.estimator, "estimate", refuse)
    memory = predict_memory(config(80.0), 1)
    assert memory["fits"] is None and memory["predicted_peak_gib"] is None
    assert memory["note"] == "n/a: parallelism.fsdp_cpu_offload = true is not supported"


def test_estimator_bug_is_not_hidden(monkeypatch):
    def broken(config):
        raise KeyError("peak")

    monkeypatch.setattr(torchtitan_ablate.estimator, "estimate", broken)
    with pytest.raises(KeyError):
        predict_memory(config(80.0), 1)


def test_epochs_are_counted_into_steps_for_the_plan(tmp_path):
    """A variant in epochs shows (and the runner's progress uses) the steps the trainer will
    derive: the data counted the same way, at the variant's global batch; one that also sets
    training.steps on the command line (the ablation file's steps) is invalid, in one line."""
    from torchtitan_ablate.ablate.ablation_file import load_spec
    from torchtitan_ablate.ablate.plan import make_plan

    study = tmp_path / "study.toml"
    study.write_text(
        '[ablation]\nconfig_file = "train_configs/debug_model.toml"\n'
        "[variants.small]\ntraining.epochs = 0.01\ntraining.seq_len = 64\n"
        "training.local_batch_size = 4\n"
        "[variants.big]\ntraining.epochs = 0.01\ntraining.seq_len = 64\n"
        "training.local_batch_size = 1\n"
    )
    made = make_plan(load_spec(study), str(study), None, [], [], estimate=False)
    # The debug corpus holds 43,232 tokens: ceil(432.32) = 433 of them.
    steps = {v["name"]: v["layout"]["steps"] for v in made["variants"]}
    assert steps == {"small": 2, "big": 7}  # ceil(433 / 256), ceil(433 / 64)
    clash = make_plan(load_spec(study), str(study), None, ["training.steps=3"], [], False)
    assert all(
        "sets both training.steps and training.epochs" in v["error"] for v in clash["variants"]
    )
