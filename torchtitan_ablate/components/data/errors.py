"""The data pipeline's user-facing error, shared by every reader (text, parquet, chat)."""

from __future__ import annotations

from torchtitan_ablate.config import ConfigError

KEY = "training.dataset_path"


class DatasetError(ConfigError):
    """Bad data under training.dataset_path: one line, exit code 2.

    A loader worker's exception reaches the main process rebuilt from one string, "Caught
    DatasetError in DataLoader worker process N.\\nOriginal Traceback ...: <message>"; only the
    message is kept, so the user still sees one line.
    """

    def __init__(self, message: str) -> None:
        name = type(self).__name__
        if message.startswith(f"Caught {name} in DataLoader worker"):
            message = message.rstrip().rsplit(f"{name}: ", 1)[-1]
        super().__init__(message)
