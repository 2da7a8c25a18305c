"""``llmgw project``: the projector process (follow and serve status), or a one-off replay into a file."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path

import click

from llmgw.bus import Bus
from llmgw.cli.options import nats_options, run
from llmgw.cli.progress import progress
from llmgw.config import Settings, data_dir
from llmgw.projections.runner import Projector
from llmgw.projections.store import Store


async def project_db(settings: Settings, db: Path, *, once: bool, snapshot: Path | None,
                     snapshot_interval_s: float, commit_every: int, commit_interval_s: float,
                     fold_snapshot_events: int | None = None,
                     fold_snapshot_interval_s: float = 600.0) -> tuple[int, int]:
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
                              snapshot_path=snapshot, snapshot_interval_s=snapshot_interval_s, writer_process=True,
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


@click.command()
@nats_options
@click.option("--db", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="DuckDB file to project into [default: <data dir>/llmgw.duckdb].")
@click.option("--once", is_flag=True, help="Replay what is stored now into --db, then exit (a private copy for analysts).")
@click.option("--snapshot", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Read-only copy for analysts, replaced atomically [default: <db>.snapshot.duckdb].")
@click.option("--snapshot-interval", default=60.0, show_default=True, help="Seconds between snapshots (0: none).")
@click.option("--commit-every", default=100_000, show_default=True, help="Commit after this many events at most.")
@click.option("--commit-interval", default=1.0, show_default=True, help="Commit at least this often (seconds) while events arrive.")
@click.option("--fold-snapshot-events", type=click.IntRange(0, 10**9), default=100_000, show_default=True,
              help="Put a snapshot of the fold on the bus (LLMGW_SNAPSHOTS) after this many events (0: none).")
@click.option("--fold-snapshot-interval", default="10m", show_default=True,
              help="… or after this long, when anything was folded (90s, 10m, 1h).")
def project(settings: Settings, db: Path | None, once: bool, snapshot: Path | None, snapshot_interval: float,
            commit_every: int, commit_interval: float, fold_snapshot_events: int, fold_snapshot_interval: str) -> None:
    """Fold the fleet, control and usage streams into DuckDB and serve `ctl status`.

    Fold snapshots let every `--replay`, `--at` and service start-up begin near
    its target instead of at sequence 1 (see `ctl status --no-snapshot`).

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
    if snapshot is None and snapshot_interval > 0 and not once:
        snapshot = db.with_name(db.stem + ".snapshot.duckdb")
    folded, total = run(project_db(settings, db, once=once, snapshot=snapshot if snapshot_interval > 0 else None,
                                   snapshot_interval_s=snapshot_interval, commit_every=commit_every,
                                   commit_interval_s=commit_interval, fold_snapshot_events=fold_snapshot_events or None,
                                   fold_snapshot_interval_s=fold_snapshot_s))
    if once:
        click.echo(f"projected {folded} new events into {db} ({total} in all)", file=sys.stderr)
