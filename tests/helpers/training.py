"""One single-process CPU training run of the debug config, small enough for a test."""

import contextlib
import io
from pathlib import Path

from torchtitan_ablate import train
from torchtitan_ablate.config import load_config, run_main

SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "4", "--metrics.log_freq", "1"]


def _argv(tmp_path: Path, args: tuple[str, ...]) -> list[str]:
    base = ["--job.config_file", "train_configs/debug_model.toml"]
    return base + ["--job.dump_folder", str(tmp_path)] + SMALL + list(args)


def run(tmp_path: Path, *args: str) -> list[dict]:
    """Trains in `tmp_path` (its dump folder) with `args` on top; returns the step records."""
    return train.main(load_config(_argv(tmp_path, args)))


def run_cli(tmp_path: Path, *args: str) -> tuple[int, list[str]]:
    """As `run`, through the command line's error handling: (exit code, the lines on stderr a
    user is told to read, and any traceback's first line)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            run_main(train.main, _argv(tmp_path, args))
            code = 0
        except SystemExit as e:
            code = e.code
    lines = err.getvalue().splitlines()
    return code, [x for x in lines if x.startswith(("error:", "config error:", "Traceback"))]
