"""Parquet documents: one document per row, the text in one string column, read one row group
at a time (a row group is parquet's unit of I/O; a whole file would not fit memory at scale).

pyarrow is an optional dependency (`pip install pyarrow`, or the `parquet` extra); it is imported
here only, when a .parquet file is given. A reader's position is the number of rows of the file
already read, so resuming skips whole row groups by their row counts in the file footer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torchtitan_ablate.components.data.errors import KEY, DatasetError


def require_pyarrow(path: Path) -> Any:
    """The pyarrow.parquet module; DatasetError (a ConfigError) when pyarrow is not installed."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(
            f"{KEY}: {path} is a parquet file and reading it needs pyarrow: pip install pyarrow "
            "(or the project's 'parquet' extra)"
        ) from None
    return pq


def _open(path: Path) -> Any:
    pq = require_pyarrow(path)
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError subclasses of its own
        raise DatasetError(f"{KEY}: {path}: not a readable parquet file ({e})") from None


def check_parquet(path: Path, field: str) -> None:
    """DatasetError unless `field` is a string column of the file (the schema only: cheap)."""
    import pyarrow as pa

    schema = _open(path).schema_arrow
    if field not in schema.names:
        raise DatasetError(
            f"{KEY}: {path} has no column {field!r} (columns: {schema.names[:10]}); set "
            "training.dataset_text_field"
        )
    tp = schema.field(field).type
    if not (pa.types.is_string(tp) or pa.types.is_large_string(tp)):
        raise DatasetError(f"{KEY}: {path}: column {field!r} is {tp}, not a string column")


def parquet_rows(path: Path, field: str, start: int) -> Iterator[str | None]:
    """The `field` value of every row from row `start` on (None for a null)."""
    pf = _open(path)
    first = 0  # index of the current row group's first row
    for group in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(group).num_rows
        if first + n > start:
            column = pf.read_row_group(group, columns=[field]).column(0).to_pylist()
            yield from column[max(start - first, 0) :]
        first += n
