"""A DCP checkpoint made to run code (a .metadata or a pickled state whose pickle calls exec) is
refused with one line and exit code 2 wherever a checkpoint is read: checkpoint.
initial_load_path, resume, scripts/convert_checkpoint.py and scripts/generate.py; the code never
runs. The same checkpoint unaltered still loads, resumes exactly and exports."""

import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.helpers.untrusted_checkpoint import CodePayload, plant_in_metadata
from torchtitan_ablate import train
from torchtitan_ablate.config import load_config, run_main

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import convert_checkpoint  # noqa: E402
import generate  # noqa: E402

BASE = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "64"]
BASE += ["--training.local_batch_size", "4", "--metrics.log_freq", "1"]
CKPT = ["--training.steps", "3", "--checkpoint.enable", "--checkpoint.interval", "2"]
REFUSED = "holds builtins.exec, which a checkpoint may not hold (loading it could run code)"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, list[dict]]:
    """A 3-step run saved at steps 2 and 3: its dump folder and its records."""
    dump = tmp_path_factory.mktemp("trained")
    return dump, train.main(load_config(BASE + CKPT + ["--job.dump_folder", str(dump)]))


def _copy(trained_dump: Path, dump: Path) -> Path:
    """A new dump folder holding the run's config.toml and step-2; returns step-2's path."""
    step = dump / "checkpoint" / "step-2"
    shutil.copytree(trained_dump / "checkpoint" / "step-2", step)
    shutil.copy(trained_dump / "config.toml", dump / "config.toml")
    return step


def _refused(capsys, run, *args) -> str:
    """The one stderr line of a run that must exit 2."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run(*args)
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_code_in_the_metadata_never_runs(trained, tmp_path, capsys):
    step = _copy(trained[0], tmp_path / "planted")
    marker = tmp_path / "ran"
    plant_in_metadata(step, marker)
    refused = f"{step}/.metadata {REFUSED}"
    fresh = BASE + ["--job.dump_folder", str(tmp_path / "fresh"), "--training.steps", "1"]
    line = _refused(
        capsys, run_main, train.main, fresh + ["--checkpoint.initial_load_path", str(step)]
    )
    assert line.startswith(f"config error: checkpoint.initial_load_path = {step}: {refused}")
    resume = BASE + CKPT + ["--job.dump_folder", str(tmp_path / "planted")]
    assert _refused(capsys, run_main, train.main, resume).startswith(f"config error: {refused}")
    line = _refused(
        capsys, convert_checkpoint.main, ["--to", "hf", str(step), str(tmp_path / "hf")]
    )
    assert line.startswith(f"convert_checkpoint: error: {step}/.metadata ") and REFUSED in line
    line = _refused(capsys, generate.main, [str(step), "--prompt", "Once upon a time"])
    assert line.startswith(f"generate: error: {step}/.metadata ") and REFUSED in line
    assert not marker.exists()
    assert not (tmp_path / "hf").exists()


def test_code_in_a_pickled_state_never_runs(trained, tmp_path, capsys):
    step = _copy(trained[0], tmp_path / "planted")
    dcp_to_torch_save(str(step), str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)  # the test's own checkpoint
    marker = tmp_path / "ran"
    whole["settings"]["pickle"] = pickle.dumps(CodePayload(marker))
    shutil.rmtree(step)
    dcp.save(whole, checkpoint_id=str(step), no_dist=True)
    resume = BASE + CKPT + ["--job.dump_folder", str(tmp_path / "planted")]
    line = _refused(capsys, run_main, train.main, resume)
    assert line.startswith(
        f"config error: cannot load checkpoint {step}: a pickled state {REFUSED}"
    )
    assert not marker.exists()


def test_an_unaltered_checkpoint_resumes_exactly_and_exports(trained, tmp_path):
    dump, full = trained
    step = _copy(dump, tmp_path / "resumed")
    rest = train.main(load_config(BASE + CKPT + ["--job.dump_folder", str(tmp_path / "resumed")]))
    assert [(r["step"], r["loss"]) for r in rest] == [(3, full[2]["loss"])]
    assert "model.safetensors" in convert_checkpoint.main(
        ["--to", "hf", str(step), str(tmp_path / "hf")]
    )
    text = generate.main([str(step), "--prompt", "Once upon a time", "--max-new-tokens", "2"])
    assert text.startswith("Once upon a time")
