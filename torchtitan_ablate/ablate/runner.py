"""Runs an ablation's planned runs through ./run_train.sh: one after another, or side by side on
disjoint GPUs of one node (`side_by_side` > 1), each into OUT/runs/<variant>/seed<N>/ with its
train.log and a status.json (ok / failed with its error line) that the report reads.

Side by side, a run gets the first free GPUs in the runner's visible order (its
CUDA_VISIBLE_DEVICES narrowed to them) and runs start in plan order: a run that needs more GPUs
than are free waits, and the runs behind it wait with it. Runs side by side share the host's
CPUs, memory bandwidth and PCIe; the report says so (docs/ablation.md).
"""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from torchtitan_ablate.ablate.environment import ROOT
from torchtitan_ablate.ablate.plan import finished_before, read_status

ERROR_LINE = re.compile(r"([A-Za-z_.]*(Error|Exception)\b|config error|out of memory)")


def error_line(log: Path, returncode: int) -> str:
    """The last informative error line of a failed run's log."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    hits = [
        x.strip()
        for x in lines
        if ERROR_LINE.search(x) and "ChildFailedError" not in x and "Traceback" not in x
    ]
    if hits:
        return hits[-1][:500]
    if returncode < 0 or returncode == 137:
        return f"killed by signal {-returncode if returncode < 0 else 9} (out of host memory?)"
    tail = [x.strip() for x in lines if x.strip()]
    return (tail[-1] if tail else "no output")[:500] + f" (exit code {returncode})"


def visible_gpus() -> list[str]:
    """The GPU ids this process may hand out: CUDA_VISIBLE_DEVICES's entries, else 0..n-1."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _new_records(metrics: Path, after_step: int) -> list[dict]:
    """The complete records logged after `after_step` (the last line may be half-written)."""
    if not metrics.is_file():
        return []
    records = []
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            break
        if rec["step"] > after_step:
            records.append(rec)
    return records


def _fmt_s(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Launched:
    """One training in flight: its process, and its progress read from metrics.jsonl.

    command: the run's shell line (`NAME=value ...` assignments, then the program); gpus: the
    GPU ids it may see (None: whatever the runner sees)."""

    def __init__(
        self,
        command: str,
        run_dir: Path,
        label: str,
        steps: int,
        timeout: float,
        gpus: list[str] | None = None,
    ) -> None:
        self.command, self.run_dir, self.label = command, run_dir, label
        self.steps, self.timeout, self.gpus = steps, timeout, gpus
        words = shlex.split(command)
        n_env = next(i for i, w in enumerate(words) if "=" not in w)
        env = dict(os.environ, MASTER_PORT=str(_free_port()))
        env.update(w.split("=", 1) for w in words[:n_env])
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        self.start = time.perf_counter()
        self.last_step, self.first = 0, None  # first logged (step, time): ETAs skip start-up
        self.log = open(run_dir / "train.log", "w")
        self.proc = subprocess.Popen(
            words[n_env:],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def poll(self, eta_rest: float) -> int | None:
        """Prints a line per newly logged step; the return code once the process ended (it is
        stopped past the timeout), else None."""
        elapsed = time.perf_counter() - self.start
        for rec in _new_records(self.run_dir / "metrics.jsonl", self.last_step):
            self.last_step = rec["step"]
            self.first = self.first or (self.last_step, elapsed)
            done, took = self.last_step - self.first[0], elapsed - self.first[1]
            per_step = took / done if done else elapsed / self.last_step
            left = per_step * (self.steps - self.last_step)
            print(
                f"  {self.label}: step {self.last_step}/{self.steps}  loss {rec['loss']:.4f}  "
                f"tps {rec['tps']:,.0f}  elapsed {_fmt_s(elapsed)}  ETA run {_fmt_s(left)}, "
                f"all {_fmt_s(left + eta_rest)}",
                flush=True,
            )
        rc = self.proc.poll()
        if rc is None and self.timeout and elapsed > self.timeout:
            self.stop()
            self.log.write(f"\nablate: run exceeded --timeout {self.timeout:.0f} s; stopped\n")
            rc = self.proc.returncode
        return rc

    @property
    def wall(self) -> float:
        return time.perf_counter() - self.start

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM to the run's process group (the trainer stops at its next step boundary),
        SIGKILL if it is still there after grace_s."""
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def run_all(
    plan: dict, out: Path, resume: bool, timeout: float = 0.0, only: set[str] | None = None
) -> None:
    """Runs every valid variant x seed (only: of these variants; up to plan["side_by_side"] at a
    time, each on its own GPUs); a failed run is recorded and the rest go on. Ctrl-C or
    SIGTERM: the runs in flight are stopped and recorded, then Stopped is raised."""
    side_by_side = plan.get("side_by_side", 1)
    chosen = [v for v in plan["variants"] if only is None or v["name"] in only]
    todo = [(v, r) for v in chosen if not v["error"] for r in v["runs"]]
    queue = []
    for i, (variant, run) in enumerate(todo, 1):
        label = f"[{i}/{len(todo)}] {variant['name']} seed {run['seed']}"
        status = read_status(out / run["dir"]) if resume else None
        if finished_before(status, run):
            print(f"{label}: finished before, skipped (--resume)", flush=True)
            continue
        if status and status["status"] == "ok":
            print(f"{label}: finished before with other arguments, run again", flush=True)
        queue.append((label, variant["layout"]["steps"], run))
    gpus = visible_gpus() if side_by_side > 1 else None
    free = list(gpus or [])
    running: list[Launched] = []
    walls: list[float] = []
    # A scheduler's SIGTERM ends the ablation like Ctrl-C: the runs in flight (each started with
    # start_new_session, so not signalled with the runner) are stopped and recorded, never
    # orphaned.
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_stopped) if on_main else None
    try:
        while queue or running:
            while queue and len(running) < side_by_side:
                label, steps, run = queue[0]
                need, mine = run.get("ngpu", plan["ngpu"]), None
                if gpus and need <= len(gpus):  # no GPUs (CPU): the runs share the cores
                    if need > len(free):
                        break
                    mine, free = free[:need], free[need:]
                elif gpus and running:
                    break  # wants more GPUs than the node has: alone, as one at a time would
                queue.pop(0)
                running.append(_start(run, out, label, steps, timeout, mine))
            time.sleep(1.0)
            mean_wall = sum(walls) / len(walls) if walls else 0.0
            for job in list(running):
                rc = job.poll(mean_wall * len(queue) / side_by_side)
                if rc is None:
                    continue
                running.remove(job)
                free += job.gpus or []
                walls.append(job.wall)
                _record(job, rc)
    except (KeyboardInterrupt, Stopped) as e:
        stopped = e if isinstance(e, Stopped) else Stopped("Ctrl-C")
        for job in running:
            job.stop()
            _record(job, job.proc.returncode, stopped_by=stopped.why)
        raise stopped from None
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)


class Stopped(Exception):
    """The runner got Ctrl-C or SIGTERM (`why`); the runs in flight were stopped and recorded."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def _raise_stopped(signum, frame) -> None:
    raise Stopped(signal.Signals(signum).name)


def _start(
    run: dict, out: Path, label: str, steps: int, timeout: float, gpus: list[str] | None
) -> Launched:
    run_dir = out / run["dir"]
    if run_dir.exists():  # metrics.jsonl appends and checkpoints resume: start clean
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    on = f" (GPUs {','.join(gpus)})" if gpus else ""
    print(f"{label}{on}: {run['command']}", flush=True)
    return Launched(run["command"], run_dir, label, steps, timeout, gpus)


def _record(job: Launched, rc: int, stopped_by: str = "") -> None:
    """status.json of a run that ended; stopped_by: what stopped the runner while it ran (a run
    that had exited cleanly by then still counts as ok)."""
    job.log.close()
    status: dict[str, Any] = {"status": "ok" if rc == 0 else "failed", "returncode": rc}
    status.update(wall_s=job.wall, command=job.command)
    status["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if job.gpus is not None:
        status["gpus"] = job.gpus
    if rc != 0 and stopped_by:
        status["error"] = f"stopped: the ablation runner got {stopped_by} (rerun with --resume)"
        print(f"{job.label}: {status['error']}", flush=True)
    elif rc != 0:
        status["error"] = error_line(job.run_dir / "train.log", rc)
        print(f"{job.label}: FAILED in {_fmt_s(job.wall)}: {status['error']}", flush=True)
    else:
        print(f"{job.label}: done in {_fmt_s(job.wall)}", flush=True)
    (job.run_dir / "status.json").write_text(json.dumps(status, indent=1) + "\n")
