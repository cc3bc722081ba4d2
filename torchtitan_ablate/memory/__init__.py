"""Memory estimation (estimation.py): lands with the memory-estimation issue."""

from torchtitan_ablate.config import ConfigError, JobConfig


def estimate_main(config: JobConfig) -> None:
    raise ConfigError(
        "memory estimation is not implemented yet (see the memory-estimation issue); "
        "run without --memory_estimation.enable"
    )
