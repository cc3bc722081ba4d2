"""Parquet documents: one document per row, the text in one string column, read one row group
at a time (a row group is parquet's unit of I/O; a whole file would not fit memory at scale).

pyarrow is an optional dependency (`pip install pyarrow`, or the `parquet` extra); it is imported
here only, when a .parquet file is given. A reader's position is the number of rows of the file
already read, so resuming skips whole row groups by their row counts in the file footer. A row
group that cannot be read (damaged data pages under an intact footer) is one DatasetError line
naming the file and row group, before training within the check's byte budget, else when read.
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


def check_parquet(path: Path, field: str, max_bytes: int = 0) -> int | None:
    """DatasetError unless `field` is a string column of the file (the schema), then unless the
    column's row groups read, as far as max_bytes of their uncompressed size go (a damaged data
    page fails here, before the model is built). The bytes read, or None when max_bytes ran out
    before the end of the file."""
    import pyarrow as pa

    pf = _open(path)
    schema = pf.schema_arrow
    if field not in schema.names:
        raise DatasetError(
            f"{KEY}: {path} has no column {field!r} (columns: {schema.names[:10]}); set "
            "training.dataset_text_field"
        )
    tp = schema.field(field).type
    if not (pa.types.is_string(tp) or pa.types.is_large_string(tp)):
        raise DatasetError(f"{KEY}: {path}: column {field!r} is {tp}, not a string column")
    used = 0
    for group, first in _row_groups(pf):
        if used >= max_bytes:
            return None
        _read_group(pf, path, field, group, first)
        used += pf.metadata.row_group(group).total_byte_size
    return used


def parquet_rows(path: Path, field: str, start: int) -> Iterator[str | None]:
    """The `field` value of every row from row `start` on (None for a null); DatasetError naming
    the file and row group when one cannot be read (damaged data pages under an intact footer)."""
    pf = _open(path)
    for group, first in _row_groups(pf):
        if first + pf.metadata.row_group(group).num_rows > start:
            yield from _read_group(pf, path, field, group, first)[max(start - first, 0) :]


def _row_groups(pf: Any) -> Iterator[tuple[int, int]]:
    """(row group, index of its first row in the file), in file order."""
    first = 0
    for group in range(pf.metadata.num_row_groups):
        yield group, first
        first += pf.metadata.row_group(group).num_rows


def _read_group(pf: Any, path: Path, field: str, group: int, first: int) -> list[str | None]:
    try:
        return pf.read_row_group(group, columns=[field]).column(0).to_pylist()
    except Exception as e:  # pyarrow's OSError / ArrowInvalid for a damaged page or codec
        why = " ".join(str(e).split())[:200]
        last = first + pf.metadata.row_group(group).num_rows - 1
        raise DatasetError(
            f"{KEY}: {path}: row group {group} (rows {first}-{last}) cannot be read ({why}): the "
            "file is damaged; write it again or take it out of the data"
        ) from None
