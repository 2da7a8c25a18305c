"""``llmgw ctl usage``: what each key, tenant or model asked, from the projector's DuckDB file."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from llmgw.cli.options import echo_json, json_option
from llmgw.config import data_dir as default_data_dir


@click.command("usage")
@click.option("--by", type=click.Choice(["key", "tenant", "model"]), default="tenant", show_default=True)
@click.option("--since", "since_days", type=click.IntRange(1, 3660), default=7, show_default=True,
              help="Days (UTC) back, today included.")
@click.option("--db", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The projector's DuckDB file (or its analysts' copy) [default: <data dir>/llmgw.duckdb].")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None, envvar="LLMGW_DATA_DIR",
              help="The data directory `llmgw up --data-dir` used [env LLMGW_DATA_DIR].")
@json_option
def usage(by: str, since_days: int, db: Path | None, data_dir: Path | None, as_json: bool) -> None:
    """Requests, errors and tokens per API key, tenant or model over the last days.

    Read from the projector's DuckDB file (its analysts' copy while a projector
    holds it): the routers' maps, projected (usage_by_key_daily).

    \b
    Example:
        llmgw ctl usage --by tenant --since 30
        llmgw ctl usage --by key --json
    """
    from llmgw.errors import ProjectionError
    from llmgw.projections import DatabaseHeldError, existing_copy_of, usage_rows

    db = db or (data_dir or default_data_dir()) / "llmgw.duckdb"
    if not db.exists():
        raise ProjectionError(f"no projection at {db}; give --db or --data-dir (where `llmgw up` keeps it)")
    try:
        rows = usage_rows(db, by, since_days)
    except DatabaseHeldError:
        copy = existing_copy_of(db)
        if not copy.exists():
            raise ProjectionError(f"{db} is held by a running projector and has no analysts' copy ({copy}); "
                                  "start the projector with --analysts-copy-interval") from None
        click.echo(f"{db} is held by a running projector: read its analysts' copy {copy}", file=sys.stderr)
        rows = usage_rows(copy, by, since_days)
    fields = (by, "requests", "errors", "prompt_tokens", "completion_tokens", "cached_tokens")
    if as_json:
        echo_json([dict(zip(fields, r, strict=True)) for r in rows])
        return
    if not rows:
        click.echo(f"no usage by API key in the last {since_days} days (keys: `llmgw ctl key list`)")
        return
    click.echo(f"{by:24} {'requests':>10} {'errors':>8} {'prompt':>12} {'completion':>12} {'cached':>12}")
    for name, requests, errors, prompt, completion, cached in rows:
        click.echo(f"{name or '-':24} {requests:>10,} {errors:>8,} {prompt:>12,} {completion:>12,} {cached:>12,}")
