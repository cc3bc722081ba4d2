"""Exports (scripts/convert_checkpoint.py): the temporary folder of an export killed with
SIGKILL is removed by the next export into the same folder, with a log line; the exported
.safetensors files get the umask's mode, as any new file."""

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan_ablate.components.checkpoint.export_folder import (
    as_umask_allows,
    remove_stale,
    temp_folder,
)
from torchtitan_ablate.models.qwen3 import Qwen3StateDictAdapter, qwen3_flavors

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "scripts"))
import convert_checkpoint  # noqa: E402

# convert_checkpoint, killed with SIGKILL halfway through writing the weights.
KILLED_MID_EXPORT = """
import os, signal, sys
sys.path.insert(0, "scripts")
import convert_checkpoint
from torchtitan_ablate.components.checkpoint import hf_export

def half_written(state, args, out_dir, **kwargs):
    (out_dir / "model.safetensors").write_bytes(b"x" * 4096)
    os.kill(os.getpid(), signal.SIGKILL)

hf_export.save_hf_checkpoint = half_written
convert_checkpoint.main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def debug_dcp(tmp_path_factory) -> Path:
    """A model-only DCP checkpoint of the debugmodel sizes."""
    path = tmp_path_factory.mktemp("ckpt") / "step-1"
    shapes = Qwen3StateDictAdapter(qwen3_flavors["debugmodel"]).native_shapes()
    dcp.save({k: torch.zeros(s) for k, s in shapes.items()}, checkpoint_id=str(path), no_dist=True)
    return path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_a_killed_exports_folder_is_removed_by_the_next_export(debug_dcp, tmp_path, caplog):
    exports = tmp_path / "exports"
    argv = ["--to", "hf", str(debug_dcp), str(exports / "a"), "--flavor", "debugmodel"]
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_EXPORT, *argv], cwd=ROOT)
    assert killed.returncode == -signal.SIGKILL
    (left,) = list(exports.iterdir())
    assert left.name.startswith(".a.") and left.name.endswith(".tmp")
    live = temp_folder(exports / "c")  # an export of this (running) process: kept
    live.mkdir()
    with caplog.at_level(logging.WARNING):
        convert_checkpoint.main([*argv[:3], str(exports / "b"), *argv[4:]])
    assert sorted(p.name for p in exports.iterdir()) == sorted(["b", live.name])
    pid = left.name.split(".")[-3]  # .a.<host>.<pid>.<random>.tmp
    assert [r.getMessage() for r in caplog.records] == [
        f"removed {left} (0.0 MiB): the temporary folder of an export of a (pid {pid}) that was "
        "killed before it could clean up"
    ]


def test_folders_of_other_hosts_and_other_files_are_left_alone(tmp_path):
    other_host = tmp_path / ".out.otherhost.1.0123abcd.tmp"
    other_host.mkdir()
    mine = tmp_path / ".out.1.tmp"  # not an export's name
    mine.mkdir()
    assert remove_stale(tmp_path) == [] and len(list(tmp_path.iterdir())) == 2


def test_exported_weights_have_the_umasks_mode(debug_dcp, tmp_path):
    out = tmp_path / "out"
    convert_checkpoint.main(["--to", "hf", str(debug_dcp), str(out), "--flavor", "debugmodel"])
    for name in ("model.safetensors", "config.json"):
        assert (out / name).stat().st_mode & 0o777 == 0o666 & ~_umask(), name  # not 0600
    f = tmp_path / "f"
    f.touch(mode=0o600)
    f.chmod(0o600)
    as_umask_allows(f)
    assert f.stat().st_mode & 0o777 == 0o666 & ~_umask()
