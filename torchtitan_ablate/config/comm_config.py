"""The [comm] section: how long a rank waits for the others. Field docstrings are the reference
text, as in job_config.py."""

from dataclasses import dataclass


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Seconds a rank waits in a collective before it fails, until the first step is done
    (start-up, model build, checkpoint load and the first, maybe compiled, step)."""

    train_timeout_seconds: int = 100
    """Seconds a rank waits in a collective after the first step before it fails with one line
    (a stalled or dead rank). Raise it when one rank may lag that long, e.g. rank 0 pruning old
    checkpoints on a slow disk while the others wait."""
