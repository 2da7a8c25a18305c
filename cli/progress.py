"""What the replaying commands share: times and durations from flags, progress on a terminal."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import click

# A plain number of seconds, or amounts with units, largest first, each once: 90s, 1h30m, 2d4h
# (what human_duration prints reads back).
_DURATION = re.compile(r"^\s*(?:\d+(?:\.\d+)?|(?:\d+(?:\.\d+)?\s*[wdhms]\s*)+)\s*$")
_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([wdhms])")
_UNITS = {"w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1}
MAX_DURATION_S = 10 * 365 * 86400  # ten years: what an event may carry (messages.Seconds), and far past any history


def parse_duration(text: str, flag: str) -> float:
    """Seconds from ``90s``, ``30m``, ``1h30m``, ``2d4h``, ``1w`` or a plain number of seconds (at most ten years)."""
    if not _DURATION.match(text):
        raise click.BadParameter(f"{text!r} is not a duration; write e.g. 90s, 30m, 1h30m, 2d4h", param_hint=flag)
    parts = _PART.findall(text)
    if not parts:
        seconds = float(text)
    else:
        sizes = [_UNITS[u] for _, u in parts]
        if sizes != sorted(set(sizes), reverse=True):
            raise click.BadParameter(f"{text!r} repeats a unit or puts a smaller one first; write e.g. 1h30m, 2d4h",
                                     param_hint=flag)
        seconds = sum(float(n) * size for (n, _), size in zip(parts, sizes, strict=True))
    if not seconds <= MAX_DURATION_S:
        raise click.BadParameter(f"{text!r} is longer than ten years (3650d); write a shorter duration",
                                 param_hint=flag)
    return seconds


def parse_time(text: str, flag: str, now: datetime | None = None) -> datetime:
    """A moment from ISO 8601 (naive means UTC) or a duration ago (``2h`` = two hours before now)."""
    if _DURATION.match(text):
        return now_or(now) - timedelta(seconds=parse_duration(text, flag))
    try:
        t = datetime.fromisoformat(text.strip().replace(" ", "T", 1) if " " in text.strip() else text.strip())
        t = t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)
    except (ValueError, OverflowError):  # OverflowError: 0001-01-01T00:00+01:00 is before year 1 in UTC
        raise click.BadParameter(
            f"{text!r} is not a time; write ISO 8601 like 2026-03-02T10:42 (UTC unless an offset is given) "
            "or a duration ago like 2h",
            param_hint=flag,
        ) from None
    return t


def now_or(now: datetime | None) -> datetime:
    return now if now is not None else datetime.now(UTC)


@contextmanager
def progress(what: str) -> Iterator[Callable[[int, int], None] | None]:
    """A progress callback (events folded of total, events/s, ETA) on a terminal; None when piped."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    console = Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]:>9} ev/s"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(what, total=None, rate="-")

        def update(done: int, total: int) -> None:
            elapsed = bar.tasks[0].elapsed or 0.0
            rate = f"{done / elapsed:,.0f}" if elapsed > 0 else "-"
            bar.update(task, completed=done, total=total or None, rate=rate)

        yield update


def human_duration(seconds: float | None) -> str:
    """``-`` for unknown (None or negative), else the two largest units: 1h32m, 3d4h, 45s, 2h."""
    if seconds is None or seconds < 0:
        return "-"
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    mi, s = divmod(s, 60)
    parts = [(d, "d"), (h, "h"), (mi, "m"), (s, "s")]
    while len(parts) > 1 and parts[0][0] == 0:
        parts.pop(0)
    return "".join(f"{v}{u}" for v, u in parts[:2] if v) or "0s"
