"""Run a function on N CPU ranks (gloo) inside a test, like OLMo-core's run_distributed_test.

    results = run_distributed(fn, 2, arg1, arg2)  # fn(arg1, arg2) on ranks 0 and 1

`fn` reads its rank from torch.distributed; it must be a module-level function (pickled by
name) and its arguments and return value must pickle. A rank's exception is re-raised in the test
with the rank's traceback attached as its cause.
"""

import contextlib
import logging
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the fork server (before its first fork), so ranks start without importing.
PRELOAD = ["torch", "torch.distributed", "torchtitan_ablate.train", "tests.helpers.distributed"]


class RemoteTraceback(Exception):
    """Carries a rank's formatted traceback (shown as the cause of the re-raised exception)."""

    def __str__(self) -> str:
        return self.args[0]


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    start_method: str | None = None,
    num_threads: int | None = 1,
    timeout_s: float = 120.0,
) -> list[Any]:
    """Runs `fn(*args)` on `world_size` ranks; returns the results in rank order.

    Not fork: it is unsafe once the parent has started CUDA or OpenMP threads. forkserver forks
    each rank from a clean server process that has imported torch and the trainer once, where
    spawn would import them in every rank (~4 s of CPU each: most of the suite's time on 2
    cores). NCCL ranks spawn (the default for backend "nccl"): the forkserver's preloaded trainer
    has touched CUDA, which a forked rank cannot inherit. `num_threads=1` keeps N ranks from
    oversubscribing a small CPU box.
    """
    if start_method is None:
        start_method = "spawn" if backend == "nccl" else "forkserver"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    results_q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, store_path, backend, num_threads, fn, args, results_q),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            outcomes = _collect(procs, results_q, timeout_s)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join(timeout=5)
    failures = [r for r, (ok, _) in outcomes.items() if not ok]  # in order of arrival
    failures += [r for r in range(world_size) if r not in outcomes]
    if failures:
        rank = failures[0]  # the first to fail is most likely the cause, the rest hung after it
        exc_bytes, tb = outcomes.get(rank, (False, (None, "no result (killed or timed out)")))[1]
        cause = RemoteTraceback(f"\n--- rank {rank} traceback ---\n{tb}")
        exc = _unpickle(exc_bytes) or RuntimeError(f"rank {rank} failed: {tb.splitlines()[-1]}")
        raise exc from cause
    return [pickle.loads(outcomes[rank][1]) for rank in range(world_size)]


def _collect(procs: list, results_q: Any, timeout_s: float) -> dict[int, tuple[bool, Any]]:
    """Gathers one outcome per rank. After the first failure the other ranks usually block in a
    collective, so they get a short grace period instead of the full timeout."""
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(outcomes) < len(procs) and time.monotonic() < deadline:
        try:
            rank, ok, payload = results_q.get(timeout=0.5)
            outcomes[rank] = (ok, payload)
            if not ok:
                deadline = min(deadline, time.monotonic() + 10.0)
        except queue.Empty:
            for rank, p in enumerate(procs):
                if rank not in outcomes and p.exitcode not in (None, 0):
                    msg = f"rank {rank} died with exit code {p.exitcode}"
                    outcomes[rank] = (False, (None, msg))
                    deadline = min(deadline, time.monotonic() + 10.0)
    return outcomes


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    backend: str,
    num_threads: int | None,
    fn: Callable[..., Any],
    args: tuple,
    results_q: Any,
) -> None:
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        # gloo connects the ranks pairwise in init: on a loaded machine a rank could finish, fail
        # at once (a test of a bad config) and close its sockets while a slower peer was still
        # connecting, which that peer reports as "Connection closed by peer".
        dist.barrier()
        result = fn(*args)
        if dist.is_initialized():  # fn may have torn the group down itself (the trainer does)
            # Without a barrier a fast rank's teardown can abort a gloo peer still in a collective.
            dist.barrier()
            dist.destroy_process_group()
        results_q.put((rank, True, pickle.dumps(result)))  # pickled here so errors are caught
    except BaseException as e:
        results_q.put((rank, False, (_pickle(e), traceback.format_exc())))
    results_q.close()
    results_q.join_thread()  # flush before the process exits


def _pickle(exc: BaseException) -> bytes | None:
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)  # some exceptions pickle but cannot be rebuilt
        return data
    except Exception:
        return None


def _unpickle(data: bytes | None) -> BaseException | None:
    return pickle.loads(data) if data is not None else None


@contextlib.contextmanager
def captured_log() -> Iterator[list[str]]:
    """The torchtitan_ablate logger's messages (INFO and up) while the block runs."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("torchtitan_ablate")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
