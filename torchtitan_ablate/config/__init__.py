from torchtitan_ablate.config.errors import ConfigError
from torchtitan_ablate.config.job_config import JobConfig
from torchtitan_ablate.config.loader import (
    check_dump_folder,
    exit_on_config_error,
    load_config,
    run_main,
    to_toml,
    write_config,
)

__all__ = [
    "ConfigError",
    "JobConfig",
    "check_dump_folder",
    "exit_on_config_error",
    "load_config",
    "run_main",
    "to_toml",
    "write_config",
]
