"""Checkpoints made to run code when loaded: a pickle whose object reduces to a call of exec,
which here only creates a marker file. Loading must refuse them before the marker exists."""

import pickle
from pathlib import Path


class CodePayload:
    """Unpickles into a call of exec that creates `marker` (and then None)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return exec, (f"open({self.marker!r}, 'w').close()",)


def plant_in_metadata(step_dir: Path, marker: Path) -> None:
    """Rewrites step_dir/.metadata with the payload riding on a valid Metadata object, so an
    unrestricted load runs it and goes on as if nothing happened."""
    path = step_dir / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # the test's own checkpoint: trusted here
    metadata.extra = CodePayload(marker)
    path.write_bytes(pickle.dumps(metadata))
