"""Launcher for more than one process (run_train.sh with NGPU > 1 or NNODES > 1): torchrun with
the trainer's promises kept.

    python -m torchtitan_ablate.launch [torchrun options] -m torchtitan_ablate.train [--key value]

What it adds to torchrun (`python -m torch.distributed.run`, whose options it takes as they are):
- The trainer's config is loaded and checked (the layout against nproc_per_node x nnodes, the
  dump folder writable and, on one node, not in use by another run) before any worker starts:
  a bad key or value is one line and exit code 2, as without torchrun. On several nodes, the
  workers' rank 0 finds a dump folder in use (a launcher cannot tell its own run's lock there).
- When workers fail, each failed rank's one-line error (config/errors.py leaves it in torchrun's
  per-rank error file) reaches the terminal, also for ranks whose output --local-ranks-filter
  (LOG_RANK) hides, and torchrun's 40-line traceback is left out. The exit code is the
  trainer's: 2 when a rank stopped on an error the user can fix, else the code all failed
  ranks share (3: NaN/Inf), else 1.
- SIGTERM (preemption): torchrun forwards it to every worker, which stops at the next step
  boundary, saves a checkpoint and exits; torchrun kills workers still running after
  TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (run_train.sh sets 300; torch's default is 30).
  Exit code 128 + the signal's number, as for a process killed by it. Ctrl-C: torchrun forwards
  it as SIGINT (the workers stop and save the same way) and a second one as SIGTERM, which ends
  the workers at once (components/preemption.py); exit code 130.
"""

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import parse_args, run

TRAINER = "torchtitan_ablate.train"
LINE_PREFIXES = ("config error:", "error:")


def check_trainer_config(
    train_args: list[str], world_size: int | None, single_node: bool = True
) -> None:
    """The checks every worker would make first, made once here (exit code 2 on failure)."""
    from torchtitan_ablate.build import check_layout
    from torchtitan_ablate.components.checkpoint.dump_lock import check_free
    from torchtitan_ablate.config import check_dump_folder, exit_on_config_error, load_config

    with exit_on_config_error():
        config = load_config(train_args)
        if world_size is not None and not config.memory_estimation.enable:
            check_layout(config, world_size)
        check_dump_folder(config.job.dump_folder)
        if single_node and not config.memory_estimation.enable:
            check_free(config.job.dump_folder)


def _world_size(nproc_per_node: str, nnodes: str) -> int | None:
    try:
        return int(nproc_per_node) * int(nnodes)
    except ValueError:  # "gpu", "1:4" (elastic): not known before the rendezvous
        return None


def failure_lines(failures: dict[int, ProcessFailure], shown: set[int] | None) -> list[str]:
    """One line per distinct failure the terminal does not show yet, the earliest first.
    shown: the local ranks whose output reaches the terminal (None: all of them)."""

    def visible(f: ProcessFailure) -> bool:
        return shown is None or f.local_rank in shown

    def when(f: ProcessFailure) -> float:
        return float(_error_data(f).get("time", f.timestamp))

    def line(f: ProcessFailure) -> str | None:
        message = f.message if isinstance(f.message, str) else ""
        return message if message.startswith(LINE_PREFIXES) else None

    on_screen = {line(f) for f in failures.values() if visible(f)}
    ranks_of: dict[str, list[int]] = {}
    for rank, f in sorted(failures.items(), key=lambda item: when(item[1])):
        if visible(f):
            continue  # its own line, or its traceback, is on the terminal already
        text = line(f)
        if text is None:
            how = f"was killed by {f.signal_name()}" if f.exitcode < 0 else "failed"
            text = (
                f"error: rank {rank} {how} (exit code {f.exitcode}); its output is hidden: "
                f"LOG_RANK={f.local_rank} shows it"
            )
        if text not in on_screen:
            ranks_of.setdefault(text, []).append(rank)
    return [
        f"{text} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})"
        for text, r in ranks_of.items()
    ]


def _meant_exit_code(f: ProcessFailure) -> int:
    """The code the rank was exiting with when it wrote its line (torchrun's SIGTERM to the
    other ranks after the first failure may have overtaken it)."""
    return int(_error_data(f).get("exit_code", f.exitcode))


def _error_data(f: ProcessFailure) -> dict:
    """What the rank left in its error file (config/errors.report), or nothing."""
    return f.error_file_data if isinstance(f.error_file_data, dict) else {}


def exit_code(codes: list[int]) -> int:
    """The trainer's exit code for the failed ranks' codes (negative: killed by a signal,
    usually torchrun's own after the first failure)."""
    if 2 in codes:  # an error the user can fix: the cause, whatever the other ranks did after
        return 2
    own = {c for c in codes if c > 0}
    return own.pop() if len(own) == 1 else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.module and args.training_script == TRAINER:
        check_trainer_config(
            args.training_script_args,
            _world_size(args.nproc_per_node, args.nnodes),
            single_node=args.nnodes in ("1", "1:1"),
        )
    shown = None
    if args.local_ranks_filter:
        shown = {int(r) for r in args.local_ranks_filter.split(",")}
    try:
        run(args)
    except ChildFailedError as e:
        # torchrun's agent has logged the failure already; its traceback would add 40 lines.
        for text in failure_lines(e.failures, shown):
            print(text, file=sys.stderr, flush=True)
        return exit_code([_meant_exit_code(f) for f in e.failures.values()])
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
