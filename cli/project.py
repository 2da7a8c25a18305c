"""``llmgw project``: the projector process (follow and serve status), or a one-off replay into a file."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path
from typing import TypeVar

import click

from llmgw.bus import Bus
from llmgw.cli.options import nats_options, run
from llmgw.cli.progress import progress
from llmgw.config import Settings, data_dir
from llmgw.fleet import SNAPSHOT_EVERY_EVENTS, SNAPSHOT_INTERVAL_S
from llmgw.projections import Projector, Store, analysts_copy_of


async def project_db(settings: Settings, db: Path, *, once: bool, analysts_copy: Path | None,
                     analysts_copy_interval_s: float, commit_every: int, commit_interval_s: float,
                     fold_snapshot_events: int | None = None,
                     fold_snapshot_interval_s: float = SNAPSHOT_INTERVAL_S) -> tuple[int, int]:
    """Run the projector on ``db``; returns (events folded in this run, positions sum)."""
    bus = await Bus.connect(settings, "llmgw-project", reconnect=not once)
    store = Store(db)
    try:
        await bus.ensure_streams(lease=False)  # the lease is the scheduler's: not the projector's to see
        if once:
            with progress(f"projecting into {db.name}") as on_progress:
                projector = Projector(bus, store, commit_every=commit_every, commit_interval_s=commit_interval_s,
                                      progress=on_progress, writer_process=True,
                                      fold_snapshot_events=fold_snapshot_events,
                                      fold_snapshot_interval_s=fold_snapshot_interval_s)
                done = await projector.run_once()
            return projector.folded, sum(done.cursor.positions.values())
        projector = Projector(bus, store, commit_every=commit_every, commit_interval_s=commit_interval_s,
                              copy_path=analysts_copy, copy_interval_s=analysts_copy_interval_s, writer_process=True,
                              fold_snapshot_events=fold_snapshot_events,
                              fold_snapshot_interval_s=fold_snapshot_interval_s)
        task = asyncio.ensure_future(projector.run_forever())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return projector.folded, sum(projector.cursor.positions.values())
    finally:
        store.close()
        await bus.close()


T = TypeVar("T")


def _renamed(old: T | None, new: T | None, old_flag: str, new_flag: str) -> T | None:
    """A value given under a flag's old name, with a warning; both names at once is a mistake."""
    if old is None:
        return new
    if new is not None:
        raise click.UsageError(f"{old_flag} is the old name of {new_flag}: give only {new_flag}")
    click.echo(f"warning: {old_flag} is now {new_flag}; the old name goes in the next release", file=sys.stderr)
    return old


@click.command()
@nats_options
@click.option("--db", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="DuckDB file to project into [default: <data dir>/llmgw.duckdb].")
@click.option("--once", is_flag=True, help="Replay what is stored now into --db, then exit (a private copy for analysts).")
@click.option("--analysts-copy", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A copy of --db for analysts to open read-only, replaced atomically "
                   "[default: <db stem>.analysts.duckdb].")
@click.option("--analysts-copy-interval", type=float, default=None,
              help="Seconds between analysts' copies (0: none)  [default: 60].")
# The names before schema 5, when the analysts' copy was also called a snapshot: kept for one release.
@click.option("--snapshot", "old_copy", type=click.Path(dir_okay=False, path_type=Path), default=None, hidden=True)
@click.option("--snapshot-interval", "old_copy_interval", type=float, default=None, hidden=True)
@click.option("--commit-every", default=100_000, show_default=True, help="Commit after this many events at most.")
@click.option("--commit-interval", default=1.0, show_default=True, help="Commit at least this often (seconds) while events arrive.")
@click.option("--fold-snapshot-events", type=click.IntRange(0, 10**9), default=SNAPSHOT_EVERY_EVENTS,
              show_default=True,
              help="Put a snapshot of the fold on the bus (LLMGW_SNAPSHOTS) after this many events (0: none).")
@click.option("--fold-snapshot-interval", default=f"{SNAPSHOT_INTERVAL_S / 60:g}m", show_default=True,
              help="… or after this long, when anything was folded (90s, 10m, 1h).")
def project(settings: Settings, db: Path | None, once: bool, analysts_copy: Path | None,
            analysts_copy_interval: float | None, old_copy: Path | None, old_copy_interval: float | None,
            commit_every: int, commit_interval: float, fold_snapshot_events: int, fold_snapshot_interval: str) -> None:
    """Fold the fleet, control and usage streams into DuckDB and serve `ctl status`.

    Fold snapshots let every `--replay`, `--at` and service start-up begin near
    its target instead of at sequence 1 (see `ctl status --no-snapshot`). The
    analysts' copy is a DuckDB file analysts open while the projector holds --db.

    Example:

        llmgw project --db llmgw.duckdb
        llmgw project --once --db mine.duckdb && duckdb mine.duckdb
    """
    from llmgw.cli.progress import parse_duration

    fold_snapshot_s = parse_duration(fold_snapshot_interval, "--fold-snapshot-interval")
    if commit_every < 1:
        raise click.BadParameter("must be at least 1", param_hint="--commit-every")
    db = db or data_dir() / "llmgw.duckdb"
    db.parent.mkdir(parents=True, exist_ok=True)
    analysts_copy = _renamed(old_copy, analysts_copy, "--snapshot", "--analysts-copy")
    interval = _renamed(old_copy_interval, analysts_copy_interval, "--snapshot-interval", "--analysts-copy-interval")
    interval = 60.0 if interval is None else interval
    if interval < 0:
        raise click.BadParameter("must be 0 (no copy) or more seconds", param_hint="--analysts-copy-interval")
    if analysts_copy is None and interval > 0 and not once:
        analysts_copy = analysts_copy_of(db)
    folded, total = run(project_db(settings, db, once=once, analysts_copy=analysts_copy if interval > 0 else None,
                                   analysts_copy_interval_s=interval, commit_every=commit_every,
                                   commit_interval_s=commit_interval, fold_snapshot_events=fold_snapshot_events or None,
                                   fold_snapshot_interval_s=fold_snapshot_s))
    if once:
        click.echo(f"projected {folded} new events into {db} ({total} in all)", file=sys.stderr)
