"""config/errors.py: which failures become one line (and which exit code), and the error file
that carries a rank's line to the launcher."""

import errno
import os

import pytest
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from torchtitan_ablate.config.errors import ConfigError, one_line, report


def test_a_full_disk_inside_dcps_exception_is_one_line(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = CheckpointException("CheckpointException ranks:dict_keys([0])", {0: (full, None)})
    line, code = one_line(wrapped, str(tmp_path))
    assert code == 2 and line.startswith("error: no space left on device (No space left on")
    assert f"writing {tmp_path} (" in line and "MiB free there)" in line
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert one_line(RuntimeError("save failed"), ".") is None
    try:
        raise RuntimeError("save failed") from quota
    except RuntimeError as e:
        assert one_line(e, ".")[0].startswith("error: no space left on device (Disk quota")


def test_torch_saves_short_write_names_the_disk(tmp_path):
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    e = CheckpointException("CheckpointException ranks:dict_keys([1])", {1: (short, None)})
    line, code = one_line(e, str(tmp_path))
    assert code == 2 and "is probably full" in line and "unexpected pos 704 vs 598" in line


def test_a_lost_peer_is_one_line_only_between_ranks(monkeypatch):
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:1234. This is typically caused by a remote worker crashing."
    )
    assert one_line(gloo) is None  # one process: not a peer's doing, keep the traceback
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    line, code = one_line(gloo)
    assert code == 1 and line.startswith(
        "error: rank 1: a collective failed (Connection closed by peer [127.0.0.1]:1234): "
    )


@pytest.mark.parametrize("e", [KeyError("x"), ValueError("bug"), SystemExit(3)])
def test_other_failures_keep_their_traceback(e):
    assert one_line(e) is None


def test_a_ctrl_c_outside_the_training_steps_is_one_line_and_exit_130():
    line, code = one_line(KeyboardInterrupt())
    assert code == 130 and line == (
        "error: interrupted (Ctrl-C) outside the training steps: nothing saved"
    )


def test_config_errors_and_the_error_file_the_launcher_reads(tmp_path, monkeypatch, capsys):
    line, code = one_line(ConfigError("training.steps = 0: must be >= 1"))
    assert (line, code) == ("config error: training.steps = 0: must be >= 1", 2)
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    report(line)
    assert capsys.readouterr().err == line + "\n"
    # torchrun's own reader of a worker's error file gets the line back.
    failure = ProcessFailure(local_rank=1, pid=1, exitcode=2, error_file=str(error_file))
    assert failure.message == line


@pytest.mark.parametrize(
    ("code", "fix"),
    [
        (errno.EACCES, "this run may not write there: fix the permissions under"),
        (errno.EPERM, "this run may not write there: fix the permissions under"),
        (errno.EROFS, "is read-only: remount it read-write"),
        (errno.EIO, "check the disk and file system under"),
        (errno.ENOENT, "check the disk and file system under"),
    ],
    ids=lambda x: errno.errorcode.get(x, ""),
)
def test_any_oserror_on_the_dump_folder_is_one_line(tmp_path, code, fix):
    path = tmp_path / "checkpoint" / "step-4.tmp" / "__0_0.distcp"
    bad = OSError(code, os.strerror(code), str(path))
    wrapped = CheckpointException("CheckpointException ranks:dict_keys([0])", {0: (bad, None)})
    line, exit_code = one_line(wrapped, str(tmp_path))
    assert exit_code == 2
    assert line == (
        f"error: {errno.errorcode[code]} ({os.strerror(code)}) on {path}: {line.split(': ', 2)[2]}"
    )
    assert fix in line and f"job.dump_folder = '{tmp_path}'" in line
    assert line.endswith(", or point job.dump_folder elsewhere")
    # A rename names its target second; another folder's error, or one before the config is
    # read, keeps its traceback.
    renamed = OSError(code, os.strerror(code), "/elsewhere/a", None, str(path))
    assert one_line(renamed, str(tmp_path))[0].split(": ")[1].endswith(f"on {path}")
    assert one_line(OSError(code, os.strerror(code), "/elsewhere/a"), str(tmp_path)) is None
    assert one_line(bad) is None


def test_a_config_error_from_a_loader_worker_keeps_its_one_line():
    class DataError(ConfigError):
        pass

    # What torch's ExceptionWrapper.reraise() builds the exception from in the main process.
    rebuilt = DataError(
        "Caught DataError in DataLoader worker process 0.\nOriginal Traceback (most recent call "
        'last):\n  File "x.py", line 1, in f\n    raise DataError(msg)\n'
        "tests.DataError: model.tokenizer_path: bad template\n"
    )
    assert str(rebuilt) == "model.tokenizer_path: bad template"
    assert str(ConfigError("Caught nothing")) == "Caught nothing"
