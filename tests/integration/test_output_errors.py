"""An OSError on the run's output folder mid-run (permissions, a read-only file system, an I/O
error) is one line naming the path and the errno, exit code 2; the checkpoints saved before are
kept and still load."""

import contextlib
import errno
import io
import os

import pytest
import torch.distributed.checkpoint.filesystem as dcp_fs

from tests.helpers.training import SMALL
from torchtitan_ablate import train
from torchtitan_ablate.components.checkpoint.folder import complete_steps
from torchtitan_ablate.config import run_main

BASE = ["--job.config_file", "train_configs/debug_model.toml", *SMALL]
BASE += ["--training.steps", "3", "--checkpoint.enable", "--checkpoint.interval", "1"]


@pytest.mark.parametrize(
    "code", [errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO], ids=errno.errorcode.get
)
def test_an_oserror_on_the_checkpoint_folder_is_one_line(tmp_path, monkeypatch, code):
    real_create = dcp_fs.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" in mode and "step-2" in str(path):  # step 1 saves; the disk fails at step 2
            raise OSError(code, os.strerror(code), str(path))
        with real_create(self, path, mode) as stream:
            yield stream

    monkeypatch.setattr(dcp_fs.FileSystem, "create_stream", create_stream)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        run_main(train.main, [*BASE, "--job.dump_folder", str(tmp_path)])
    assert e.value.code == 2
    lines = [x for x in err.getvalue().splitlines() if x.startswith(("error", "Traceback"))]
    assert len(lines) == 1, err.getvalue()[-3000:]
    name, text = errno.errorcode[code], os.strerror(code)
    assert lines[0].startswith(f"error: {name} ({text}) on {tmp_path}/checkpoint/step-2.tmp/")
    assert lines[0].endswith("or point job.dump_folder elsewhere")
    assert f"job.dump_folder = '{tmp_path}'" in lines[0]
    assert complete_steps(str(tmp_path / "checkpoint")) == [1]
    monkeypatch.undo()  # the disk is back: the run resumes from step 1
    records = run_main(train.main, [*BASE, "--job.dump_folder", str(tmp_path)])
    assert [r["step"] for r in records] == [2, 3]
