"""The answers that need no torch, given before an entry point imports it (seconds): --help, and
a config that the loader rejects (an unknown key, a wrong type, a value the rules refuse).

    python -m torchtitan_ablate.config.precheck [--job.config_file X] [--section.key value ...]

checks the config alone: exit code 0 when it loads, else its one line and exit code 2. run_train.sh
runs it first, so a typo costs a fraction of a second, not the environment check, the GPU count
and the trainer's imports (three torch imports). This package imports no torch
(tests/unit/config/test_precheck.py holds it to that).
"""

import sys

from torchtitan_ablate.config.help import exit_if_help
from torchtitan_ablate.config.loader import exit_on_config_error, load_config


def check_before_torch(argv: list[str], prog: str, launcher: bool = True) -> None:
    """--help (exit 0), or a config error (one line, exit 2); returns when the config loads.
    launcher: the trainer's entry points (their help lists run_train.sh's environment)."""
    exit_if_help(argv, prog, launcher)
    with exit_on_config_error():
        load_config(argv)


if __name__ == "__main__":
    check_before_torch(sys.argv[1:], "./run_train.sh")
