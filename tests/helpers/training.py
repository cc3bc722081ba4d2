"""One single-process CPU training run of the debug config, small enough for a test."""

from pathlib import Path

from torchtitan_ablate import train
from torchtitan_ablate.config import load_config

SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "4", "--metrics.log_freq", "1"]


def run(tmp_path: Path, *args: str) -> list[dict]:
    """Trains in `tmp_path` (its dump folder) with `args` on top; returns the step records."""
    config = load_config(
        ["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path)]
        + SMALL
        + list(args)
    )
    return train.main(config)
