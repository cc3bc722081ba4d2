"""torchtitan_ablate/launch.py: which failed ranks' lines reach the terminal (the end-to-end
runs are in tests/integration/test_launcher.py)."""

import json
import os

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from torchtitan_ablate.launch import _meant_exit_code, exit_code, failure_lines, set_omp_threads


def _failure(tmp_path, rank: int, exitcode: int, line: str | None, time: float) -> ProcessFailure:
    """A failed rank as torchrun reports it, with the error file config/errors.report writes."""
    path = tmp_path / f"error{rank}.json"
    if line is not None:
        data = {"message": line, "timestamp": int(time), "time": time, "exit_code": exitcode}
        path.write_text(json.dumps(data))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))


def test_hidden_ranks_lines_once_each_and_earliest_first(tmp_path):
    data = "config error: training.dataset_path: bad.jsonl:3: invalid JSON"
    lost = "error: rank {}: a collective failed (Connection closed by peer)"
    failures = {
        0: _failure(tmp_path, 0, 1, lost.format(0), 10.5),  # LOG_RANK=0: on the terminal already
        1: _failure(tmp_path, 1, 2, data, 10.1),
        2: _failure(tmp_path, 2, 2, data, 10.2),
        3: _failure(tmp_path, 3, 1, None, 11.0),  # a traceback in its own (hidden) output
        4: _failure(tmp_path, 4, -9, None, 12.0),
        5: _failure(tmp_path, 5, 1, lost.format(5), 10.6),
    }
    assert failure_lines(failures, shown={0}) == [
        f"{data} (ranks 1, 2)",
        lost.format(5) + " (rank 5)",
        "error: rank 3 failed (exit code 1); its output is hidden: LOG_RANK=3 shows it (rank 3)",
        "error: rank 4 was killed by SIGKILL (exit code -9); its output is hidden: LOG_RANK=4 "
        "shows it (rank 4)",
    ]


def test_lines_the_terminal_shows_are_not_repeated(tmp_path):
    line = "config error: job.dump_folder = '/x': cannot create it (Permission denied)"
    failures = {r: _failure(tmp_path, r, 2, line, 5.0 + r) for r in range(2)}
    assert failure_lines(failures, shown={0}) == []  # rank 0 printed the same line
    assert failure_lines(failures, shown=None) == []  # every rank's output is shown
    assert failure_lines(failures, shown={1}) == []
    assert failure_lines(failures, shown={7}) == [f"{line} (ranks 0, 1)"]


def test_the_exit_code_is_the_trainers():
    assert exit_code([1, 2, -15]) == 2  # a data error on one rank, a lost peer on another
    assert exit_code([3, 3]) == 3  # NaN/Inf: every rank stops alike
    assert exit_code([3, -15]) == 3
    assert exit_code([1, 3]) == 1
    assert exit_code([-9]) == 1


def test_a_rank_killed_after_writing_its_line_keeps_its_exit_code(tmp_path):
    f = _failure(tmp_path, 1, 2, "config error: x", 1.0)
    f.exitcode = -15  # torchrun's SIGTERM reached the rank on its way out
    assert _meant_exit_code(f) == 2 and exit_code([-6, _meant_exit_code(f)]) == 2


@pytest.mark.parametrize(
    ("env", "nproc", "cores", "expected"),
    [
        (None, "2", 8, "4"),  # the cores shared out among the local workers
        (None, "4", 2, "1"),  # at least 1
        (None, "1", 8, None),  # one worker: torch's own default (all cores), as torchrun
        ("3", "2", 8, "3"),  # the user's value stands
    ],
)
def test_omp_threads_unless_the_user_set_them(monkeypatch, env, nproc, cores, expected):
    monkeypatch.setenv("OMP_NUM_THREADS", env or "")  # restored after the test
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS")
    set_omp_threads(nproc, cores=cores)
    assert os.environ.get("OMP_NUM_THREADS") == expected
