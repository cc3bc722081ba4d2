"""Faults a run meets on CPU ranks (docs/reliability.md): preemption on one rank, a stalled
rank, a full disk during a checkpoint, an unwritable dump folder, a new run or a resume in an
old run's folder. Each ends in a saved checkpoint or one line on stderr, never a hang."""

import contextlib
import errno
import io
import json
import os
import signal
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_fs

from tests.helpers.distributed import captured_log, run_distributed
from torchtitan_ablate import train
from torchtitan_ablate.config import run_main

BASE = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "64"]
BASE += ["--training.local_batch_size", "2"]


def _args(dump: Path, *more: str) -> list[str]:
    return BASE + ["--job.dump_folder", str(dump), *more]


def _run(args: list[str]) -> tuple[int, list[str]]:
    """(exit code, error lines on stderr) of run_main(train.main, args) in this process (the
    log may share stderr: only the lines the user is told to read are kept)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            run_main(train.main, args)
            code = 0
        except SystemExit as e:
            code = e.code
    lines = err.getvalue().splitlines()
    return code, [x for x in lines if x.startswith(("error:", "config error:", "Traceback"))]


def _preempt_one_rank(args: list[str], signalled_rank: int, at_step: int) -> list[str]:
    """Trains with SIGTERM sent to `signalled_rank` during step `at_step`; returns this rank's
    log lines about stopping and saving."""
    real_step = train.Trainer.train_step

    def step_then_signal(self, batches):
        out = real_step(self, batches)
        if self.step == at_step and dist.get_rank() == signalled_rank:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    train.Trainer.train_step = step_then_signal
    try:
        with captured_log() as lines:
            assert _run(args)[0] == 0
    finally:
        train.Trainer.train_step = real_step
    return [x for x in lines if "stopping" in x or "SIGTERM" in x or "saved checkpoint" in x]


def test_sigterm_on_one_rank_stops_every_rank_within_two_steps(tmp_path):
    # log_freq 100: before, the stop waited for the next logged step (here: never, step 6 ran).
    # The ranks' vote on step 2 is read once step 3 is queued (no host wait for the GPU).
    args = _args(tmp_path, "--training.steps", "6", "--metrics.log_freq", "100")
    args += ["--checkpoint.enable", "--checkpoint.interval", "100"]
    rank0, rank1 = run_distributed(_preempt_one_rank, 2, args, 1, 2)
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-3"]
    assert any("stopping at step 3 (SIGTERM; checkpoint saved)" in x for x in rank0), rank0
    assert any("SIGTERM: stopping at the end of this step or the next" in x for x in rank1), rank1


def _stall_rank_1(args: list[str], at_step: int) -> tuple[int, list[str], float]:
    """Rank 1 sleeps 6 s in step `at_step`; returns (exit code, stderr, seconds this rank spent
    from the start of that step to its exit)."""
    # As torchrun sets them (the one-line error names the rank; the test harness sets neither).
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()))
    real_step = train.Trainer.train_step
    started = []

    def stalling_step(self, batches):
        if self.step == at_step:
            started.append(time.monotonic())
            if dist.get_rank() == 1:
                time.sleep(6)
        return real_step(self, batches)

    train.Trainer.train_step = stalling_step
    try:
        code, err = _run(args)
    finally:
        train.Trainer.train_step = real_step
    return code, err, time.monotonic() - started[0]


def test_a_stalled_rank_fails_the_others_within_the_train_timeout(tmp_path):
    # comm.train_timeout_seconds applies from step 2 (the first step runs under the init one).
    args = _args(tmp_path, "--training.steps", "5", "--comm.train_timeout_seconds", "2")
    (code0, err0, waited0), (code1, err1, _) = run_distributed(
        _stall_rank_1, 2, args, 3, timeout_s=60
    )
    assert code0 == 1 and 1.5 < waited0 < 15, (code0, waited0, err0)  # the default waits 100 s
    assert err0 == [
        "error: rank 0: a collective failed (Timed out waiting 2000ms for recv operation to "
        "complete): another rank failed, stalled (comm.train_timeout_seconds) or was stopped; "
        "its error says why"
    ]
    assert code1 == 1 and len(err1) == 1 and err1[0].startswith("error: rank 1: a collective")


class _FullDisk(io.RawIOBase):
    """A file on a disk with `room` bytes left: writes past it fail as the OS's would."""

    def __init__(self, room: int) -> None:
        self.room, self.pos = room, 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def write(self, b) -> int:
        if self.pos + len(b) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.pos += len(b)
        return len(b)


def test_a_full_disk_during_a_checkpoint_is_one_line(tmp_path, monkeypatch):
    real_create = dcp_fs.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" in mode:
            yield _FullDisk(room=4096)
        else:
            with real_create(self, path, mode) as stream:
                yield stream

    monkeypatch.setattr(dcp_fs.FileSystem, "create_stream", create_stream)
    code, err = _run(_args(tmp_path, "--training.steps", "2", "--checkpoint.enable"))
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: no space left on device (No space left on device) writing")
    assert "point job.dump_folder at another disk" in err[0]


def test_an_unwritable_dump_folder_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    dump = tmp_path / "file" / "run"  # chmod would not stop root: a path under a file does
    assert _run(_args(dump, "--training.steps", "1")) == (
        2,
        [f"config error: job.dump_folder = '{dump}': cannot create it (Not a directory)"],
    )


def _steps(path: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


def test_metrics_jsonl_is_one_runs_rows(tmp_path):
    common = ["--training.steps", "3", "--metrics.log_freq", "1"]
    assert _run(_args(tmp_path, *common))[0] == 0
    first = _steps(tmp_path / "metrics.jsonl")
    # A new run in the same folder starts its own file; the earlier one is kept beside it.
    assert _run(_args(tmp_path, *common, "--optimizer.lr", "1e-4"))[0] == 0
    (old,) = [p for p in tmp_path.iterdir() if p.name not in ("metrics.jsonl", "config.toml")]
    assert old.name.startswith("metrics.") and _steps(old) == first
    assert [s for s, _ in _steps(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert _steps(tmp_path / "metrics.jsonl") != first


def test_a_resumed_run_replaces_the_rows_after_its_checkpoint(tmp_path):
    common = ["--training.steps", "4", "--metrics.log_freq", "1", "--checkpoint.enable"]
    assert _run(_args(tmp_path, *common, "--training.exit_at_step", "2"))[0] == 0
    with open(tmp_path / "metrics.jsonl", "a") as f:  # step 3 of a run that died before saving
        f.write(json.dumps({"step": 3, "loss": 99.0}) + "\n")
    assert _run(_args(tmp_path, *common))[0] == 0
    steps = _steps(tmp_path / "metrics.jsonl")
    assert [s for s, _ in steps] == [1, 2, 3, 4] and 99.0 not in [x for _, x in steps]
