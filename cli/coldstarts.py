"""``ctl model show``'s cold starts: each wake and scale-up with its phases, and what they cost the requests held."""

from __future__ import annotations

from datetime import datetime

from rich.console import Console

from llmgw import messages as m
from llmgw.fleet import percentile


def _after(t: datetime | None, since: datetime | None) -> str:
    if t is None:
        return "-"
    if since is None:
        return t.strftime("%H:%M:%S")
    return f"+{(t - since).total_seconds():.2f}s"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"


def summary_line(d: m.ModelDetail) -> str:
    """Count, p50/p95 from wanted to first byte, the last one, and the requests that waited."""
    starts = d.cold_starts
    if not starts:
        return f"Cold starts: none (no wake or scale-up of {d.summary.name} in its history)"
    totals = [t for c in starts if (t := c.total_s) is not None]
    waits = [w for c in starts for w in c.waits_s]
    waited = sum(c.requests for c in starts)
    last = starts[-1]
    kept = "" if d.cold_start_count == len(starts) else f"; figures over the latest {len(starts)}"
    line = (f"Cold starts: {d.cold_start_count} ({sum(c.cause == 'wake' for c in starts)} wakes, "
            f"{sum(c.cause == 'scale-up' for c in starts)} scale-ups{kept}) · wanted → first byte "
            f"p50 {_s(percentile(totals, 50))} p95 {_s(percentile(totals, 95))} · last {last.replica_id} at "
            f"{last.placed_at:%Y-%m-%d %H:%M:%S} UTC ({_s(last.total_s)})")
    if waited:
        line += (f" · {waited} request{'s' if waited != 1 else ''} waited "
                 f"(p50 {_s(percentile(waits, 50))}, p95 {_s(percentile(waits, 95))})")
    fetched = [c for c in starts if c.fetching_at is not None]
    if fetched:  # its agents keep files: wakes on a node that had them against those that fetched them first
        cached = [t for c in starts if c.fetching_at is None and (t := c.total_s) is not None]
        uncached = [t for c in fetched if (t := c.total_s) is not None]
        downloads = [x for c in fetched if (x := c.download_s) is not None]
        line += (f" · files on the node: {len(cached)}, p50 {_s(percentile(cached, 50))} p95 "
                 f"{_s(percentile(cached, 95))} · fetched first: {len(fetched)}, p50 {_s(percentile(uncached, 50))} "
                 f"p95 {_s(percentile(uncached, 95))} (download p50 {_s(percentile(downloads, 50))})")
    return line


def render_cold_starts(d: m.ModelDetail, console: Console, rows: int = 10) -> None:
    """The summary line and the latest ``rows`` cold starts, each phase after the one it starts from."""
    from rich import box
    from rich.table import Table

    console.print(summary_line(d))
    if not d.cold_starts:
        console.print()
        return
    table = Table(box=box.SIMPLE)
    for col in ("replica", "cause", "wanted (UTC)", "placed", "started", "healthy", "released", "first byte",
                "requests", "total"):
        table.add_column(col, justify="right" if col in ("requests", "total") else "left")
    for c in d.cold_starts[-rows:]:
        start = c.wanted_at or c.placed_at
        table.add_row(c.replica_id, c.cause, c.wanted_at.strftime("%Y-%m-%d %H:%M:%S") if c.wanted_at else "-",
                      _after(c.placed_at, start), _after(c.started_at, start), _after(c.healthy_at, start),
                      _after(c.released_at, start), _after(c.first_byte_at, start),
                      str(c.requests) if c.requests else "-", _s(c.total_s))
    console.print(table)
