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
from typing import TYPE_CHECKING, Any

from llmgw import messages as m
from llmgw import subjects
from llmgw.errors import ProjectionError
from llmgw.fleet import snapshots
from llmgw.fleet.fold import EVERY, Checkpoint, Memories, fold_batch
from llmgw.fleet.snapshots import Warn
from llmgw.fleet.state import Cursor

if TYPE_CHECKING:
    from llmgw.bus import Bus
    from llmgw.bus.frames import RawMsg

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None] | None
# What ``fleet.status.report`` reads of a fold beyond the state: the models' history. A fold only for a
# report (``ctl status --replay``/``--at``) keeps no other memory: the scheduler's, planner's and routers'
# were a sixth of its fold (issue 46).
STATUS_KEEPS = Memories(history=True, demand=False, observed=False, pool=False, lost=False)


async def replay(bus: Bus, *, at: datetime | None = None, at_seq: tuple[str, int] | None = None,
                 streams: tuple[str, ...] = subjects.HISTORY_STREAMS, progress: Progress = None,
                 use_snapshots: bool = True, warn: Warn | None = None,
                 upto: dict[str, int] | None = None, keep: Memories = EVERY) -> Checkpoint:
    """The fold of ``streams`` as stored now, or as of ``at`` / right after ``at_seq`` (STREAM, SEQ).

    It starts from the newest fold snapshot that lies wholly before that target
    (``use_snapshots=False``: from sequence 1); ``warn`` hears why a snapshot was skipped.
    The models' history and the services' memory come with it (``Checkpoint``).
    ``upto`` (stream → sequence) stops each stream there instead: a projector whose checkpoint
    predates them folds them again up to its cursor. ``keep``: the memories folded (a snapshot brings
    every one as of its position; those not kept stay there).
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
    readers = {}
    for stream, stop in stops.items():
        start = cursor.positions.get(stream, 0) + 1
        if start <= stop:
            readers[stream] = bus.reader(stream, start, stop_at=stop, idle_expires_s=2.0, purpose="replay")
    from llmgw.bus import windows

    # The streams as one history, in windows of stored time, as the projector catches up; with a
    # moment, each stream ends at its first message stored after it.
    async with contextlib.aclosing(windows(readers, cuts)) as merged:  # type: ignore[type-var]
        async for window in merged:
            for stream, msgs in window:
                stored, events = _decoded(cursor, stream, msgs)
                if events:
                    fold_batch(checkpoint, stream, stored, events, keep=keep)
                done += len(msgs)
            if progress is not None:
                progress(done, total)
    return checkpoint


def _decoded(cursor: Cursor, stream: str, msgs: list[RawMsg]) -> tuple[list[RawMsg], list[Any]]:
    """The messages that decode, and their events; one that does not is folded past, as the projector does."""
    def skip(raw: RawMsg, _: Exception) -> None:
        cursor.unprojected += 1
        _advance(cursor, stream, raw)

    return m.decode_each(stream, msgs, subjects.DECODERS[stream].decode, skip, who="replay")


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
