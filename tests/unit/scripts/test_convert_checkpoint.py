"""scripts/convert_checkpoint.py: bad inputs are one line and exit code 2, and a failed
conversion leaves no output folder behind."""

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan_ablate.config import load_config, to_toml
from torchtitan_ablate.models.qwen3 import Qwen3StateDictAdapter, qwen3_flavors

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import convert_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def debug_dcp(tmp_path_factory) -> Path:
    """A model-only DCP checkpoint of the debugmodel sizes (no config.toml, no config.json)."""
    path = tmp_path_factory.mktemp("ckpt") / "step-1"
    shapes = Qwen3StateDictAdapter(qwen3_flavors["debugmodel"]).native_shapes()
    dcp.save({k: torch.zeros(s) for k, s in shapes.items()}, checkpoint_id=str(path), no_dist=True)
    return path


def fails(argv: list[str], capsys, usage: bool = False) -> str:
    """The error line of a run that must exit 2 (after argparse's usage for option errors)."""
    with pytest.raises(SystemExit) as e:
        convert_checkpoint.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and (usage or len(err) == 1), err
    return err[-1]


@pytest.mark.parametrize(
    "flavor, message",
    [
        ("0.6B", "does not match the model sizes"),
        ("debugmodel_moe", "0 entries of another shape, 16 missing; e.g. no layers.0.moe"),
        ("debugmodle", "'debugmodle' is neither a flavor name (debugmodel, debugmodel_moe, 0.6B"),
        (None, "cannot tell the model sizes"),
    ],
)
def test_wrong_sizes_are_named_and_nothing_is_written(debug_dcp, tmp_path, capsys, flavor, message):
    out = tmp_path / "out"
    argv = ["--to", "hf", str(debug_dcp), str(out)] + (["--flavor", flavor] if flavor else [])
    assert message in fails(argv, capsys)
    assert list(tmp_path.iterdir()) == []  # neither out nor its temporary folder


def test_bad_sources_and_options(debug_dcp, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = str(tmp_path / "out")
    line = fails(["--to", "hf", str(empty), out, "--flavor", "debugmodel"], capsys)
    assert "is not a DCP checkpoint (no .metadata)" in line
    assert "holds no config.json" in fails(["--to", "dcp", str(debug_dcp), out], capsys)
    for shard in ("0", "-1"):
        argv = ["--to", "hf", str(debug_dcp), out, "--max_shard_gib", shard]
        assert f"--max_shard_gib {shard}: the shard size" in fails(argv, capsys, usage=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_converts_into_a_new_folder_only(debug_dcp, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--to", "hf", str(debug_dcp), str(out), "--flavor", "debugmodel"]
    assert convert_checkpoint.main(argv) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the temporary folder was renamed
    assert "exists and is not an empty folder" in fails(argv, capsys)


@pytest.mark.parametrize(
    "damage, message",
    [
        ("cut", "is damaged: its tensors cannot be read (RuntimeError: PytorchStreamReader "),
        ("emptied", "is damaged: its tensors cannot be read (EOFError); convert another step"),
        ("metadata", ".metadata is damaged (UnpicklingError"),
    ],
)
def test_a_damaged_checkpoint_is_one_line(debug_dcp, tmp_path, capsys, damage, message):
    ckpt = tmp_path / "step-1"
    shutil.copytree(debug_dcp, ckpt)
    if damage in ("cut", "emptied"):  # a copy or a save that stopped part-way
        (shard,) = ckpt.glob("*.distcp")
        os.truncate(shard, shard.stat().st_size // 2 if damage == "cut" else 1000)
    else:
        (ckpt / ".metadata").write_bytes(b"\x80\x04garbage")
    argv = ["--to", "hf", str(ckpt), str(tmp_path / "out"), "--flavor", "debugmodel"]
    assert message in fails(argv, capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]


def test_the_output_folder_has_the_usual_permissions(debug_dcp, tmp_path):
    umask = os.umask(0o022)  # read it back (and keep it)
    os.umask(umask)
    out = tmp_path / "out"
    convert_checkpoint.main(["--to", "hf", str(debug_dcp), str(out), "--flavor", "debugmodel"])
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700


@pytest.mark.parametrize(
    "flavor, key, value, hf_key",
    [("debugmodel", "n_layers", 2, "num_hidden_layers"), ("debugmodel_moe", "num_experts", 4,
     "num_experts")],
)  # fmt: skip
def test_a_checkpoint_without_a_record_takes_the_runs_overrides(
    tmp_path, capsys, flavor, key, value, hf_key
):
    """A model-only step-0 (a seed checkpoint records no settings) of a run with model.n_layers
    or num_experts overridden: the sizes come from the run's config.toml, with all its
    overrides (before: only vocab_size), and a warning says where they came from."""
    step = tmp_path / "run" / "checkpoint" / "step-0"
    shapes = Qwen3StateDictAdapter(
        dataclasses.replace(qwen3_flavors[flavor], **{key: value})
    ).native_shapes()
    dcp.save({k: torch.zeros(s) for k, s in shapes.items()}, checkpoint_id=str(step), no_dist=True)
    config = load_config(["--model.flavor", flavor, f"--model.{key}", str(value)])
    (tmp_path / "run" / "config.toml").write_text(to_toml(config))
    convert_checkpoint.main(["--to", "hf", str(step), str(tmp_path / "hf")])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())[hf_key] == value
    (warning,) = capsys.readouterr().err.strip().splitlines()
    assert warning.startswith(f"convert_checkpoint: warning: {step} records no model settings")
    assert f"read from {tmp_path / 'run' / 'config.toml'}, which the run's latest" in warning
