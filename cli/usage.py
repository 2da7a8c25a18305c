"""``llmgw ctl usage``: what each key, tenant or model asked, from the projector's DuckDB file, or live."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

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
              help="Read this DuckDB file (a projector's, its analysts' copy, a private replay) instead of asking "
                   "the running projector.")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None, envvar="LLMGW_DATA_DIR",
              help="Where `llmgw up --data-dir` keeps llmgw.duckdb: read when no projector answers "
                   "[env LLMGW_DATA_DIR].")
@json_option
@nats_options
def usage(by: str, since_days: int, live: bool, db: Path | None, data_dir: Path | None, as_json: bool,
          settings: Settings) -> None:
    """Requests, errors (429s and 403s apart) and tokens per API key, tenant, model or adapter over the last days.

    Asked of the running projector, which answers from its DuckDB file once it has
    committed every event stored when you asked (the routers' maps, projected:
    usage_by_key_daily). With no projector, or with --db, read from the file (its
    analysts' copy while a projector holds it, rewritten every --analysts-copy-interval:
    its age is printed). Requests with no key (a router that asks for none) are the key
    "-", shown as (anonymous), and count in --by model and --by tenant (tenant ""). --live
    gives the fold's figures today and over seven days instead.

    \b
    Example:
        llmgw ctl usage --by tenant --since 30
        llmgw ctl usage --by key --json
        llmgw ctl usage --by adapter
        llmgw ctl usage --db mine.duckdb --by model
        llmgw ctl usage --live
    """
    if live:
        _live(settings, by, as_json)
        return
    rows: list[tuple[Any, ...]] | None = None
    source = ""
    if db is None:
        from llmgw import ctl

        why: list[str] = []
        answer = ctl.projector_usage(settings, by, since_days, notice=why.append)
        if answer is not None:
            table, as_of = answer
            rows = [(r.name, r.requests, r.errors, r.throttled, r.forbidden, r.prompt_tokens, r.completion_tokens,
                     r.cached_tokens) for r in table.rows]
            source = "the running projector" + (f" (events up to {_time(as_of)} UTC)" if as_of else "")
            click.echo(f"from {source}", file=sys.stderr)
        else:
            db = (data_dir or default_data_dir()) / "llmgw.duckdb"
            click.echo(f"{'; '.join(why)}: reading {db}", file=sys.stderr)
    if rows is None:
        assert db is not None
        rows, source = _from_file(db)(by, since_days)
    if as_json:
        echo_json([dict(zip((by, *FIELDS), r, strict=True)) for r in rows])
        return
    if not rows:
        click.echo(f"no usage in the last {since_days} days in {source}; "
                   "`llmgw ctl usage --live` for the fold's figures (keys: `llmgw ctl key list`)")
        return
    click.echo(f"{by:24} {'requests':>10} {'errors':>8} {'429':>7} {'403':>7} {'prompt':>12} {'completion':>12} "
               f"{'cached':>12}")
    for name, requests, errors, throttled, forbidden, prompt, completion, cached in rows:
        click.echo(f"{_shown(by, name):24} {requests:>10,} {errors:>8,} {throttled:>7,} {forbidden:>7,} "
                   f"{prompt:>12,} {completion:>12,} {cached:>12,}")


FIELDS = ("requests", "errors", "throttled", "forbidden", "prompt_tokens", "completion_tokens", "cached_tokens")


def _from_file(db: Path) -> Callable[[str, int], tuple[list[tuple[Any, ...]], str]]:
    """The usage rows of ``db`` (its analysts' copy while a projector holds it, with its age), and their source."""
    from llmgw.errors import ProjectionError
    from llmgw.projections import DatabaseHeldError, existing_copy_of, usage_rows

    def read(by: str, since_days: int) -> tuple[list[tuple[Any, ...]], str]:
        if not db.exists():
            raise ProjectionError(f"no projection at {db} and no projector answered; start one (`llmgw up`, "
                                  "`llmgw project`), or give --db or --data-dir (where `llmgw up` keeps it)")
        try:
            return usage_rows(db, by, since_days), str(db)
        except DatabaseHeldError:
            copy = existing_copy_of(db)
            if not copy.exists():
                raise ProjectionError(f"{db} is held by a running projector and has no analysts' copy ({copy}); "
                                      "leave --db out to ask the projector, or use --live") from None
            age = f"written {human_duration(max(0.0, time.time() - copy.stat().st_mtime))} ago"
            click.echo(f"{db} is held by a running projector: read its analysts' copy {copy} ({age}; leave --db "
                       "out to ask the projector for the figures up to now)", file=sys.stderr)
            return usage_rows(copy, by, since_days), f"{copy} ({age})"

    return read


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
