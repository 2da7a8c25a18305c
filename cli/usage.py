"""``llmgw ctl usage``: what each key, tenant or model asked, from the projector's DuckDB file, or live."""

from __future__ import annotations

import sys
import time
from datetime import datetime
from pathlib import Path

import click

from llmgw.cli.options import echo_json, json_option, nats_options, run
from llmgw.cli.progress import human_duration
from llmgw.config import Settings
from llmgw.config import data_dir as default_data_dir

ANONYMOUS = "-"  # the routers' name for requests that came with no key (messages.usage.ANONYMOUS_CALLER)


def _shown(by: str, name: str | None) -> str:
    if by == "key" and name == ANONYMOUS:
        return "(anonymous)"
    return name or "-"


@click.command("usage")
@click.option("--by", type=click.Choice(["key", "tenant", "model", "adapter"]), default="tenant", show_default=True,
              help="Sum per API key, tenant, model, or LoRA adapter (an adapter's requests, by its own name).")
@click.option("--since", "since_days", type=click.IntRange(1, 3660), default=7, show_default=True,
              help="Days (UTC) back, today included.")
@click.option("--live", is_flag=True,
              help="What the routers reported up to now, today and over seven days: per tenant from the status "
                   "service (a projector), per key folded here; not the DuckDB file.")
@click.option("--db", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The projector's DuckDB file (or its analysts' copy) [default: <data dir>/llmgw.duckdb].")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None, envvar="LLMGW_DATA_DIR",
              help="The data directory `llmgw up --data-dir` used [env LLMGW_DATA_DIR].")
@json_option
@nats_options
def usage(by: str, since_days: int, live: bool, db: Path | None, data_dir: Path | None, as_json: bool,
          settings: Settings) -> None:
    """Requests, errors and tokens per API key, tenant or model over the last days.

    Read from the projector's DuckDB file (its analysts' copy while a projector
    holds it, rewritten every --analysts-copy-interval: its age is printed): the
    routers' maps, projected (usage_by_key_daily). Requests with no key (a router
    that asks for none) are the key "-", shown as (anonymous). --live asks for the
    figures up to now instead.

    \b
    Example:
        llmgw ctl usage --by tenant --since 30
        llmgw ctl usage --by key --json
        llmgw ctl usage --by adapter
        llmgw ctl usage --live
    """
    if live:
        _live(settings, by, as_json)
        return
    from llmgw.errors import ProjectionError
    from llmgw.projections import DatabaseHeldError, existing_copy_of, usage_rows

    db = db or (data_dir or default_data_dir()) / "llmgw.duckdb"
    if not db.exists():
        raise ProjectionError(f"no projection at {db}; give --db or --data-dir (where `llmgw up` keeps it)")
    source, age = db, ""
    try:
        rows = usage_rows(db, by, since_days)
    except DatabaseHeldError:
        copy = existing_copy_of(db)
        if not copy.exists():
            raise ProjectionError(f"{db} is held by a running projector and has no analysts' copy ({copy}); "
                                  "start the projector with --analysts-copy-interval, or use --live") from None
        source = copy
        age = f"written {human_duration(max(0.0, time.time() - copy.stat().st_mtime))} ago"
        click.echo(f"{db} is held by a running projector: read its analysts' copy {copy} ({age}; --live for the "
                   "figures up to now)", file=sys.stderr)
        rows = usage_rows(copy, by, since_days)
    fields = (by, "requests", "errors", "prompt_tokens", "completion_tokens", "cached_tokens")
    if as_json:
        echo_json([dict(zip(fields, r, strict=True)) for r in rows])
        return
    if not rows:
        click.echo(f"no usage in the last {since_days} days in {source}{f' ({age})' if age else ''}; "
                   "`llmgw ctl usage --live` for what the routers reported up to now (keys: `llmgw ctl key list`)")
        return
    click.echo(f"{by:24} {'requests':>10} {'errors':>8} {'prompt':>12} {'completion':>12} {'cached':>12}")
    for name, requests, errors, prompt, completion, cached in rows:
        click.echo(f"{_shown(by, name):24} {requests:>10,} {errors:>8,} {prompt:>12,} {completion:>12,} {cached:>12,}")


def _live(settings: Settings, by: str, as_json: bool) -> None:
    from llmgw import ctl

    rows, as_of = run(ctl.live_usage(settings, by))
    fields = (by, "requests_today", "tokens_today", "requests_7d", "tokens_7d")
    if as_json:
        echo_json([dict(zip(fields, r, strict=True)) for r in rows])
        return
    when = f"as of {_time(as_of)} UTC" if as_of else "nothing folded yet"
    source = "the status service" if by == "tenant" else "the control and usage streams, folded here"
    click.echo(f"live, from {source} ({when}); today and the last 7 days (UTC)")
    if not rows:
        click.echo("no usage reported yet")
        return
    click.echo(f"{by:24} {'requests today':>15} {'tokens today':>14} {'requests 7d':>12} {'tokens 7d':>14}")
    for name, rt, tt, r7, t7 in rows:
        click.echo(f"{_shown(by, name):24} {rt:>15,} {tt:>14,} {r7:>12,} {t7:>14,}")


def _time(t: datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S")
