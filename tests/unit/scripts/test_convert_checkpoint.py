"""scripts/convert_checkpoint.py: bad inputs are one line and exit code 2, and a failed
conversion leaves no output folder behind."""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

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
