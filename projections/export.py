"""``llmgw export --parquet``: the projection as Parquet files, for tools that do not read DuckDB.

A running projector holds its file (DuckDB allows no reader beside a writer
process), so the export reads the analysts' copy next to it, and says
how old that is; a file nobody holds (a stopped projector, ``project --once``)
is read directly.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from llmgw.errors import ProjectionError
from llmgw.projections.store import HISTORY_TABLES, DatabaseHeldError, copy_to_parquet

# The history tables with a time: one folder per day. The rest are small (the current
# views, bookkeeping) or have no time of their own (unprojected_events): one file each.
BY_DAY = tuple(t for t in HISTORY_TABLES if t != "unprojected_events")


def analysts_copy_of(db: Path) -> Path:
    """Where ``llmgw project`` puts the analysts' copy of ``db`` by default."""
    return db.with_name(db.stem + ".analysts.duckdb")


def legacy_copy_of(db: Path) -> Path:
    """Where projectors before schema 5 put it (``<db stem>.snapshot.duckdb``): still read, for one release."""
    return db.with_name(db.stem + ".snapshot.duckdb")


def existing_copy_of(db: Path) -> Path:
    """The analysts' copy of ``db`` to read while a projector holds it: under its name, else the name
    before schema 5, else where it would be (which does not exist)."""
    legacy = legacy_copy_of(db)
    return legacy if not analysts_copy_of(db).exists() and legacy.exists() else analysts_copy_of(db)


@dataclass(frozen=True)
class Exported:
    source: Path  # the file read: the database, or its analysts' copy
    from_copy: bool
    rows: dict[str, int]  # per table
    views: dict[str, int]  # per view, as it read at the export
    as_of: datetime | None  # the newest event in it


def export_parquet(db: Path, dest: Path) -> Exported:
    """Write every table of ``db`` (or, while a projector holds it, of its analysts' copy) as Parquet under ``dest``.

    ``dest`` must not exist or be empty; it appears whole or not at all (written
    beside it, then renamed).
    """
    if not db.exists():
        raise ProjectionError(f"no database at {db}; give --db, or build one with `llmgw project --once --db {db}`")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ProjectionError(f"{dest} exists and is not an empty directory; choose a new one (the export "
                              "writes a whole tree)")
    partial = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    source, from_copy = db, False
    try:
        try:
            rows, views, as_of = copy_to_parquet(db, partial, BY_DAY)
        except DatabaseHeldError:
            source, from_copy = existing_copy_of(db), True
            if not source.exists():
                raise ProjectionError(
                    f"{db} is held by a running projector and has no analysts' copy ({source}); export a private "
                    f"copy: `llmgw project --once --db mine.duckdb && llmgw export --parquet {dest} --db "
                    "mine.duckdb`, or start the projector with one (--analysts-copy-interval)") from None
            rows, views, as_of = copy_to_parquet(source, partial, BY_DAY)
        if dest.exists():
            dest.rmdir()  # empty, checked above
        partial.rename(dest)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return Exported(source, from_copy, rows, views, as_of)
