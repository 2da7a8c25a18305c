"""Fold the history streams here, in memory, up to now or up to a moment: ``--replay``, ``--at``, ``--at-seq``.

The same fold the projector runs, read through the one follow loop; no DuckDB.
A stream is read up to the sequence stored last when the replay started (or the
one ``--at-seq`` names), and with a moment, up to the last message the server
stored by then: the server's clock orders what was known when, not the events'.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

from llmgw import subjects
from llmgw.errors import ProjectionError
from llmgw.fleet.fold import Cursor, FleetState, apply, clamp_times

if TYPE_CHECKING:
    from llmgw.bus import Bus
    from llmgw.bus.frames import RawMsg

Progress = Callable[[int, int], None] | None


async def replay(bus: Bus, *, at: datetime | None = None, at_seq: tuple[str, int] | None = None,
                 streams: tuple[str, ...] = subjects.HISTORY_STREAMS,
                 progress: Progress = None) -> tuple[FleetState, Cursor]:
    """The fold of ``streams`` as stored now, or as of ``at`` / right after ``at_seq`` (STREAM, SEQ)."""
    at_ns = int(at.timestamp() * 1e9) if at is not None else None
    if at_seq is not None:
        at_ns = await message_ts_ns(bus, *at_seq)
    stops = {s: await bus.stream_last_seq(s) for s in streams}
    if at_seq is not None:
        stops[at_seq[0]] = at_seq[1]
    state, cursor = FleetState(), Cursor()
    total, done = sum(stops.values()), 0
    for stream, stop in stops.items():
        if stop == 0:
            continue
        # With a moment, a stream stops there; the stream --at-seq names stops at its sequence.
        cut = None if at_seq is not None and stream == at_seq[0] else at_ns
        past = False

        def skipped(raw: RawMsg, _: Exception, stream: str = stream, cut: int | None = cut) -> None:
            if cut is None or raw.ts_ns <= cut:  # an undecodable message is folded past, as the projector does
                cursor.unprojected += 1
                cursor.positions[stream] = max(cursor.positions.get(stream, 0), raw.seq)

        follower = bus.follow(stream, subjects.DECODERS[stream], stop_at=stop, idle_expires_s=2.0, who="replay",
                              on_skip=skipped)
        async with contextlib.aclosing(follower.batches()) as batches:  # type: ignore[type-var]
            async for batch in batches:
                if cut is not None and batch and batch[-1].raw.ts_ns > cut:
                    k = next(i for i, d in enumerate(batch) if d.raw.ts_ns > cut)
                    batch, past = batch[:k], True
                events = [d.event for d in batch]
                cursor.clamped += clamp_times(events, [d.raw.ts_ns for d in batch])
                for event in events:
                    apply(state, event)
                if batch:
                    cursor.positions[stream] = max(cursor.positions.get(stream, 0), batch[-1].raw.seq)
                done += len(batch)
                if progress is not None:
                    progress(done, total)
                if past:
                    break
    return state, cursor


async def message_ts_ns(bus: Bus, stream: str, seq: int) -> int:
    """When the stream stored message ``seq``."""
    last = await bus.stream_last_seq(stream)
    if not 1 <= seq <= last:
        raise ProjectionError(f"{stream} holds sequences 1..{last}; there is no {stream}:{seq}")
    reader = bus.reader(stream, seq, batch=1, stop_at=seq)
    async with contextlib.aclosing(reader.batches()) as batches:  # type: ignore[type-var]
        async for msgs in batches:
            for x in msgs:
                if x.seq == seq:
                    return x.ts_ns
            break
    raise ProjectionError(f"{stream}:{seq} was deleted from the stream; pick another sequence or use --at TIME")
