from torchtitan_ablate.config.errors import ConfigError
from torchtitan_ablate.config.job_config import JobConfig
from torchtitan_ablate.config.manager import (
    exit_on_config_error,
    load_config,
    run_main,
    to_toml,
    write_config,
)

__all__ = [
    "ConfigError",
    "JobConfig",
    "exit_on_config_error",
    "load_config",
    "run_main",
    "to_toml",
    "write_config",
]
