"""Fold the history streams here, in memory, up to now or up to a moment: ``--replay``, ``--at``, ``--at-seq``.

The same fold the projector runs, read through the one follow loop; no DuckDB.
A stream is read up to the sequence stored last when the replay started (or the
one ``--at-seq`` names), and with a moment, up to the last message the server
stored by then: the server's clock orders what was known when, not the events'.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

from llmgw import subjects
from llmgw.errors import ProjectionError
from llmgw.fleet import snapshots
from llmgw.fleet.checkpoint import Checkpoint, fold_batch
from llmgw.fleet.fold import Cursor
from llmgw.fleet.snapshots import Warn

if TYPE_CHECKING:
    from llmgw.bus import Bus
    from llmgw.bus.frames import RawMsg

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None] | None


async def replay(bus: Bus, *, at: datetime | None = None, at_seq: tuple[str, int] | None = None,
                 streams: tuple[str, ...] = subjects.HISTORY_STREAMS, progress: Progress = None,
                 use_snapshots: bool = True, warn: Warn | None = None,
                 upto: dict[str, int] | None = None) -> Checkpoint:
    """The fold of ``streams`` as stored now, or as of ``at`` / right after ``at_seq`` (STREAM, SEQ).

    It starts from the newest fold snapshot that lies wholly before that target
    (``use_snapshots=False``: from sequence 1); ``warn`` hears why a snapshot was skipped.
    The models' history and the services' memory come with it (``Checkpoint``).
    ``upto`` (stream → sequence) stops each stream there instead: a projector whose checkpoint
    predates them folds them again up to its cursor.
    """
    at_ns = int(at.timestamp() * 1e9) if at is not None else None
    if at_seq is not None:
        at_ns = await message_ts_ns(bus, *at_seq)
    heads = {s: await bus.stream_head(s) for s in streams}
    stops = {s: last for s, (last, _) in heads.items()}
    if at_seq is not None:
        stops[at_seq[0]] = at_seq[1]
    if upto is not None:
        stops = {s: min(last, upto.get(s, 0)) for s, last in stops.items()}
    # With a moment, every stream stops there; the stream --at-seq names stops at its sequence.
    cuts = {s: at_ns for s in streams if at_ns is not None and not (at_seq is not None and s == at_seq[0])}
    checkpoint = Checkpoint()
    if use_snapshots:
        found = await snapshots.load(bus, snapshots.Target(stops=stops, cut_ns=cuts), heads,
                                     warn or (lambda line: log.warning("%s", line)))
        if found is not None:
            checkpoint = found[0]
    cursor = checkpoint.cursor
    for stream, (_, created) in heads.items():
        if created:
            cursor.stream_created[stream] = created
    total = sum(max(0, stop - cursor.positions.get(stream, 0)) for stream, stop in stops.items())
    done = 0
    for stream, stop in stops.items():
        start = cursor.positions.get(stream, 0) + 1
        if stop < start:
            continue
        cut = cuts.get(stream)
        past = False

        def skipped(raw: RawMsg, _: Exception, stream: str = stream, cut: int | None = cut) -> None:
            if cut is None or raw.ts_ns <= cut:  # an undecodable message is folded past, as the projector does
                cursor.unprojected += 1
                _advance(cursor, stream, raw)

        follower = bus.follow(stream, subjects.DECODERS[stream], start, stop_at=stop, idle_expires_s=2.0,
                              who="replay", on_skip=skipped)
        async with contextlib.aclosing(follower.batches()) as batches:  # type: ignore[type-var]
            async for batch in batches:
                if cut is not None and batch and batch[-1].raw.ts_ns > cut:
                    k = next(i for i, d in enumerate(batch) if d.raw.ts_ns > cut)
                    batch, past = batch[:k], True
                fold_batch(checkpoint, stream, [d.raw for d in batch], [d.event for d in batch])
                done += len(batch)
                if progress is not None:
                    progress(done, total)
                if past:
                    break
    return checkpoint


def _advance(cursor: Cursor, stream: str, raw: RawMsg) -> None:
    if raw.seq > cursor.positions.get(stream, 0):
        cursor.positions[stream], cursor.stored_ns[stream] = raw.seq, raw.ts_ns


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
