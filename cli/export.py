"""``llmgw export``: the projection's tables as files for other tools."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from llmgw.config import data_dir as default_data_dir


@click.command("export")
@click.option("--parquet", "dest", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory to create: one Parquet file per table, the history tables one folder per day.")
@click.option("--db", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The projector's DuckDB file, or its analysts' copy or a private copy "
                   "[default: <data dir>/llmgw.duckdb].")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None, envvar="LLMGW_DATA_DIR",
              help="The data directory `llmgw up --data-dir` used [env LLMGW_DATA_DIR; default: "
                   "~/.local/share/llmgw].")
def export(dest: Path, db: Path | None, data_dir: Path | None) -> None:
    """Write the projection's tables as Parquet (pandas, Spark, Polars, any DuckDB).

    A running projector holds its file, so its analysts' copy (<db stem>.analysts.duckdb)
    is exported instead, and the time it reaches is printed.

    \b
    Example:
        llmgw export --parquet llmgw-parquet
        llmgw export --parquet out --db mine.duckdb
        duckdb -c "FROM read_parquet('out/idle_history/*/*.parquet', hive_partitioning = true)"
    """
    from llmgw.projections import export_parquet

    db = db or (data_dir or default_data_dir()) / "llmgw.duckdb"
    done = export_parquet(db, dest)
    if done.from_copy:
        click.echo(f"{db} is held by a running projector: exported its analysts' copy {done.source}", file=sys.stderr)
    as_of = done.as_of.isoformat() if done.as_of else "no events"
    click.echo(f"{dest}: {len(done.rows)} tables, {sum(done.rows.values()):,} rows, and {len(done.views)} views, "
               f"as of {as_of} "
               f"(from {done.source})")
