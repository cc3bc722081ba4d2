"""The console commands of pyproject.toml's [project.scripts] point at callables of the package
that behave as their repository twins (python -m torchtitan_ablate.train, estimation.py,
scripts/ablate.py)."""

import importlib
import sys
from pathlib import Path

import pytest

from torchtitan_ablate import cli

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_console_commands_declared():
    assert SCRIPTS == {
        "ttablate-train": "torchtitan_ablate.cli:train",
        "ttablate-estimate": "torchtitan_ablate.cli:estimate",
        "ttablate-ablate": "torchtitan_ablate.ablate.cli:main",
    }
    for target in SCRIPTS.values():
        module, _, name = target.partition(":")
        assert callable(getattr(importlib.import_module(module), name)), target


def test_estimate_config_error_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.estimate(["--training.steps", "x"])
    assert e.value.code == 2 and "training.steps = 'x'" in capsys.readouterr().err


def test_train_runs_the_trainer_module_as_main(monkeypatch, capsys):
    # A config error is the trainer's __main__ answering (one line, exit 2), without training.
    monkeypatch.setattr(sys, "argv", ["ttablate-train", "--training.steps", "x"])
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)  # the module sets it: undone
    with pytest.raises(SystemExit) as e:
        cli.train()
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "config error: command line: training.steps = 'x' is not valid; expected an integer"
    ]
