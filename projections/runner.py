"""The projector: read the history streams from the checkpoint, fold, commit, serve status.

Reading, decoding and folding happen on the event loop; DuckDB commits run on
one writer thread, so a slow disk never stalls the NATS connection into a slow
consumer. A commit carries the rows, the encoded state and the positions of
the same instant, so what is on disk is always a prefix of every stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus, RawMsg, split_window, windows
from llmgw.errors import BusError, PermissionDeniedError, ProjectionError
from llmgw.fleet import gpuuse, snapshots
from llmgw.fleet import status as status_report
from llmgw.fleet.fold import Checkpoint, encode, fold_batch
from llmgw.fleet.history import ModelHistory
from llmgw.fleet.state import FOLD_VERSION, Cursor
from llmgw.projections.store import Batch, Store, add_unprojected, idle_payload
from llmgw.projections.writer import ProcessWriter

log = logging.getLogger(__name__)

DECODERS = subjects.DECODERS
# One decode call per batch: the stream's messages joined as a JSON array.
BATCH_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    subjects.STREAM_FLEET: msgspec.json.Decoder(list[m.FleetEvent]),
    subjects.STREAM_CONTROL: msgspec.json.Decoder(list[m.ControlEvent]),
    subjects.STREAM_USAGE: msgspec.json.Decoder(list[m.UsageEvent]),
}

# Two: the reader folds the next batch while the writer commits one and holds another.
COMMITS_IN_FLIGHT = 2
READ_ATTEMPTS = 8  # about a minute of backoff before a projector gives up on a stream

Progress = Callable[[int, int], None]


# Folding makes thousands of short-lived, acyclic objects a batch (decoded events, their
# tuples, rows), which refcounting frees. At CPython's default first threshold (700
# allocations) the cycle collector still ran ~7,000 times over the replay benchmark's
# history and took 3.6 s of the reading process's 23 s of CPU, rescanning the batch in
# hand each time; at 50,000 it runs ~35 times (0.5 s). Cycles are still collected.
GC_THRESHOLDS = (50_000, 20, 10)
_gc_users = 0
_gc_saved = gc.get_threshold()
_gc_lock = threading.Lock()  # projectors may fold in several threads (ctl status --replay next to a live one)


@contextlib.contextmanager
def fewer_gc_passes() -> Iterator[None]:
    """Raise the collector's thresholds while any projector folds; put them back after the last."""
    global _gc_users, _gc_saved
    with _gc_lock:
        if _gc_users == 0:
            _gc_saved = gc.get_threshold()
            gc.set_threshold(*GC_THRESHOLDS)
        _gc_users += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_users -= 1
            if _gc_users == 0:
                gc.set_threshold(*_gc_saved)


async def _all_or_none(reads: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Run the stream readers together; when one fails or this is cancelled, stop them all first.

    A plain gather leaves the others folding while the caller flushes, and
    waits forever for a reader that ignored its cancellation: Python 3.11's
    ``asyncio.wait_for`` (in nats-py's requests and the reader's waits) can
    swallow a cancel that arrives as its inner await completes (fixed in
    3.12), and the reader then follows its stream on. So: cancel again until
    each has stopped.
    """
    tasks = [asyncio.ensure_future(r) for r in reads]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        pending = {t for t in tasks if not t.done()}
        while pending:
            for t in pending:
                t.cancel()
            _, pending = await asyncio.wait(pending, timeout=1.0)
        for t in tasks:  # read every outcome, so that none is reported as never retrieved
            if not t.cancelled():
                t.exception()
        raise


class Projector:
    """Folds the history streams into a FleetState and, when given a store, into DuckDB."""

    def __init__(
        self,
        bus: Bus,
        store: Store | None = None,
        *,
        streams: Sequence[str] = subjects.HISTORY_STREAMS,
        commit_every: int = 100_000,
        commit_interval_s: float = 1.0,
        copy_path: str | Path | None = None,
        copy_interval_s: float = 60.0,
        batch: int = 8192,
        progress: Progress | None = None,
        writer_process: bool = False,
        fold_snapshot_events: int | None = None,
        fold_snapshot_interval_s: float = snapshots.DEFAULT_INTERVAL_S,
    ) -> None:
        self.bus = bus
        self.store = store
        self.streams = tuple(streams)
        # Fold snapshots on the bus (llmgw/fleet/snapshots.py), every so many events or so long; None: off.
        self.fold_snapshot_events = fold_snapshot_events
        self.fold_snapshot_interval_s = fold_snapshot_interval_s
        self._fold_snapshot_at = (0, time.monotonic())  # (events folded, when) at the last one
        self._fold_snapshot_tasks: list[asyncio.Task[None]] = []  # the one being written, the next
        self.fold_snapshots_written = 0
        self.commit_every = commit_every
        self.commit_interval_s = commit_interval_s
        self.copy_path = Path(copy_path) if copy_path else None  # the analysts' copy
        self.copy_interval_s = copy_interval_s
        self.read_batch = batch
        self.progress = progress
        checkpoint = store.load() if store is not None else Checkpoint()
        # The fold and what the services keep beyond it (llmgw/fleet/fold.py), one object.
        self.checkpoint = checkpoint
        self.state, self.cursor = checkpoint.state, checkpoint.cursor  # the same objects, for the hot path
        # A checkpoint from an older version lacks the models' history and the services' memory.
        self._incomplete = not checkpoint.complete()
        self.batch = Batch()
        self.folded = 0
        self._progress = asyncio.Event()  # set whenever a batch is folded: status requests wait on it
        self.committed = 0
        self._total = 0
        self._lock = asyncio.Lock()
        self._inflight: deque[asyncio.Future[None]] = deque()
        self._write_failed: str | None = None
        self._last_commit = time.monotonic()
        self._last_copy = 0.0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmgw-duckdb") if store else None
        self.gpu_samples: gpuuse.GpuSamples | None = None  # followed while serving status
        self._process: ProcessWriter | None = None
        if store is not None and writer_process and store.path != ":memory:":
            # The child owns the file from here on; this process only reads NATS and folds.
            store.close()
            self._process = ProcessWriter(store.path, self.copy_path, copy_interval_s)

    # --- folding -------------------------------------------------------------------

    def ingest(self, stream: str, msgs: list[RawMsg]) -> None:
        """Decode and fold one batch of a stream; what cannot be decoded, or is refused, is kept raw."""
        datas = [x.data for x in msgs]
        try:
            decoded: list[Any] = BATCH_DECODERS[stream].decode(b"[" + b",".join(datas) + b"]")
            if len(decoded) != len(msgs):
                raise msgspec.DecodeError("batch framing")
        except m.DECODE_ERRORS:  # ValidationError is a DecodeError; deep nesting a RecursionError
            self._ingest_one_by_one(stream, msgs)
            return
        self._fold(stream, msgs, decoded)
        self._folded(stream, msgs)

    def _fold(self, stream: str, msgs: list[RawMsg], decoded: list[Any]) -> None:
        """The one fold every reader runs (``fold_batch``), and the rows it makes: a batch folded whole
        goes in as columns (the common case, kept lean), one with a refusal event by event."""
        state, store = self.state, self.store
        payloads = [x.data for x in msgs]  # idle maps' replaced by what changed in them
        idle = m.IdleMapPublished

        def before(i: int, event: m.Event, moved: list[str] | None) -> None:
            if type(event) is idle:
                payloads[i] = idle_payload(event, state.routers.get(event.router), moved)

        clamped = self.cursor.clamped
        why = fold_batch(self.checkpoint, stream, msgs, decoded, before=before if store is not None else None)
        if self.cursor.clamped > clamped:
            self._clamped(stream, self.cursor.clamped - clamped)
        refused = [i for i, w in enumerate(why) if w is not None]
        for i in refused:
            raw = msgs[i]
            log.warning("%s:%d (%s) refused, kept in unprojected_events: %s", stream, raw.seq, raw.subject, why[i])
        if store is None:
            return
        if not refused:
            self.batch.add_raw(stream, [x.seq for x in msgs], [x.subject for x in msgs], [x.ts_ns for x in msgs],
                               payloads)
            return
        for i, raw in enumerate(msgs):
            if why[i] is None:  # an idle map's payload is its changes already (``before``)
                self.batch.add_raw(stream, [raw.seq], [raw.subject], [raw.ts_ns], [payloads[i]])
            else:
                add_unprojected(self.batch, stream, raw.seq, raw.subject, raw.data, why[i] or "")

    def _ingest_one_by_one(self, stream: str, msgs: list[RawMsg]) -> None:
        """A batch with an event that cannot be decoded: those are kept raw, the rest folded as ever."""
        def skip(raw: RawMsg, e: Exception) -> None:
            add_unprojected(self.batch, stream, raw.seq, raw.subject, raw.data, str(e))
            self.cursor.unprojected += 1

        good, decoded = m.decode_each(stream, msgs, DECODERS[stream].decode, skip, who="projector",
                                    skipped="kept in unprojected_events")
        if good:
            self._fold(stream, good, decoded)
        self._folded(stream, msgs)

    def _folded(self, stream: str, msgs: list[RawMsg]) -> None:
        self.folded += len(msgs)
        self._advance(stream, msgs[-1])
        if self.progress is not None:
            self.progress(self.folded, self._total)

    @property
    def history(self) -> ModelHistory:
        return self.checkpoint.history

    def _advance(self, stream: str, last: RawMsg) -> None:
        self.cursor.positions[stream], self.cursor.stored_ns[stream] = last.seq, last.ts_ns
        self._progress.set()

    def _clamped(self, stream: str, n: int) -> None:
        log.warning("%s: %d event(s) dated too far from when the stream stored them, folded at the stored time "
                    "(%d so far)", stream, n, self.cursor.clamped)

    # --- committing -----------------------------------------------------------------

    def _write(self, batch: Batch, checkpoint: bytes) -> None:
        """One commit, on the writer thread; after a failed one, none (its rows would be missing)."""
        if self._write_failed is not None:
            raise ProjectionError(f"not committed: an earlier commit failed ({self._write_failed})")
        try:
            self._write_one(batch, checkpoint)
        except Exception as e:
            self._write_failed = str(e) or type(e).__name__
            raise

    def _write_one(self, batch: Batch, checkpoint: bytes) -> None:
        assert self.store is not None
        if self._process is not None:
            self._process.commit(batch, checkpoint)
            self.committed += batch.events
            return
        self.store.commit(batch, checkpoint)
        self.committed += batch.events
        if self.copy_path is not None and time.monotonic() - self._last_copy >= self.copy_interval_s:
            self.store.export_copy(self.copy_path)
            self._last_copy = time.monotonic()

    async def commit(self, *, force: bool = False) -> None:
        """Hand the rows folded so far, with the state and positions they lead to, to the writer."""
        if self.store is None or self._pool is None:
            return
        async with self._lock:
            # Up to COMMITS_IN_FLIGHT batches queue for the writer thread, which commits them
            # in order; the reader waits only when the writer is that far behind.
            await self._settle(COMMITS_IN_FLIGHT - 1)
            if not self.batch.events and not force:
                return
            batch, self.batch = self.batch, Batch()
            # Streams arrive in any order; sorted positions make the same state the same bytes.
            self.cursor.positions = dict(sorted(self.cursor.positions.items()))
            self.cursor.stream_created = dict(sorted(self.cursor.stream_created.items()))
            self.cursor.stored_ns = dict(sorted(self.cursor.stored_ns.items()))
            blob = encode(self.checkpoint)
            await self._maybe_fold_snapshot(blob)
            self._last_commit = time.monotonic()
            loop = asyncio.get_running_loop()
            self._inflight.append(loop.run_in_executor(self._pool, self._write, batch, blob))

    def _fold_snapshot_due(self) -> bool:
        """Whether a fold snapshot is due: so many events, or so long with any."""
        every = self.fold_snapshot_events
        if every is None:
            return False
        folded, when = self._fold_snapshot_at
        fresh = self.folded - folded
        return fresh > 0 and (fresh >= every or time.monotonic() - when >= self.fold_snapshot_interval_s)

    def _till_fold_snapshot(self) -> int:
        """How many more events fold before a snapshot is due by count (any number: none is): a catch-up
        cuts its windows there, or one lands at the end of the window that passes it, thousands later."""
        every = self.fold_snapshot_events
        return 1 << 62 if every is None else max(1, every - (self.folded - self._fold_snapshot_at[0]))

    async def _maybe_fold_snapshot(self, blob: bytes | None = None) -> None:
        """Put the state on the bus when a snapshot is due (``blob``: the state just encoded, if it was).

        One is written while the next waits its turn; a third waits for the first. A due snapshot is never
        skipped: a gap of twice the cadence is a ``--at`` that folds twice as far (issue 46)."""
        if not self._fold_snapshot_due():
            return
        writing = [t for t in self._fold_snapshot_tasks if not t.done()]
        if len(writing) >= 2:
            await asyncio.wait(writing[:1])
        blob = blob if blob is not None else encode(self.checkpoint)
        self._fold_snapshot_at = (self.folded, time.monotonic())
        c = self.cursor
        cursor = Cursor(positions=dict(c.positions), unprojected=c.unprojected, clamped=c.clamped,
                        stream_created=dict(c.stream_created), stored_ns=dict(c.stored_ns))
        before = writing[-1] if writing else None
        task = asyncio.ensure_future(self._write_fold_snapshot(blob, cursor, before))
        self._fold_snapshot_tasks = [*(t for t in writing if not t.done()), task]

    async def _write_fold_snapshot(self, blob: bytes, cursor: Cursor, before: asyncio.Task[None] | None) -> None:
        if before is not None:
            await asyncio.wait([before])  # in order: the newest snapshot on the bus is the newest state
        if self.fold_snapshot_events is None:
            return  # the one before found it may not write them
        try:
            name = await snapshots.write(self.bus, blob, cursor, time.time_ns())
        except BusError as e:  # a projector without the right to write them still projects
            log.warning("fold snapshot not written: %s", e)
            if isinstance(e, PermissionDeniedError):
                self.fold_snapshot_events = None
            return
        self.fold_snapshots_written += 1
        log.info("fold snapshot %s written (%s bytes)", name, f"{len(blob):,}")

    async def _fold_snapshot_done(self) -> None:
        for task in self._fold_snapshot_tasks:
            with contextlib.suppress(Exception):
                await task

    async def flush(self) -> None:
        """Commit what is folded and wait until it is on disk."""
        await self.commit()
        async with self._lock:
            await self._settle(0)
        await self._fold_snapshot_done()

    async def _settle(self, keep: int) -> None:
        """Await commits in flight, oldest first, until ``keep`` remain; raise the first that failed.

        Shielded: a cancelled wait must not cancel a commit still queued on the
        writer thread, or it would be skipped and the next one written after it.
        """
        while len(self._inflight) > keep or (self._inflight and self._inflight[0].done()):
            try:
                await asyncio.shield(self._inflight[0])
            except asyncio.CancelledError:
                if not self._inflight[0].cancelled():
                    raise  # our wait was cancelled; the commit goes on and stays in line
                self._write_failed = self._write_failed or "a commit was cancelled before it ran"
                self._inflight.popleft()
                raise
            except BaseException:
                # The ones queued behind it write nothing; read their errors so none is left unread.
                self._inflight.popleft()
                await asyncio.gather(*(asyncio.shield(f) for f in self._inflight), return_exceptions=True)
                self._inflight.clear()
                raise
            self._inflight.popleft()

    async def _maybe_commit(self) -> None:
        await self._maybe_fold_snapshot()  # every so many events, whatever the commit cadence
        if self.batch.events >= self.commit_every or (
            self.batch.events and time.monotonic() - self._last_commit >= self.commit_interval_s
        ):
            await self.commit()

    # --- reading --------------------------------------------------------------------

    async def _read(self, stream: str, stop_at: int | None) -> None:
        """Read one stream from the folded position; a busy or restarting server is waited out."""
        await self._retrying(f"reading {stream}", lambda: self._read_from_position(stream, stop_at), (stream,))

    async def _retrying(self, what: str, read: Callable[[], Awaitable[None]], streams: Iterable[str]) -> None:
        """Run ``read`` until it succeeds, waiting out a busy or restarting server with back-off; it
        restarts after what was folded, so nothing is read twice."""
        delay = 0.5
        for attempt in range(1, READ_ATTEMPTS + 1):
            try:
                await read()
                return
            except (TimeoutError, BusError) as e:
                if attempt == READ_ATTEMPTS:
                    at = ", ".join(f"{s}:{self.cursor.positions.get(s, 0)}" for s in streams)
                    raise ProjectionError(f"{what} failed {attempt} times, last: {e or type(e).__name__}; "
                                          f"folded up to {at} (committed work is kept)") from e
                log.warning("%s: %s; retrying in %.1fs", what, e or type(e).__name__, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _check_same_stream(self, stream: str) -> None:
        """Refuse to go on from positions folded out of another incarnation of a stream.

        A stream deleted and declared again (storage lost, restored from an
        older backup, re-created to change its config) restarts at sequence 1.
        Reading on from the old position would skip the new stream's events
        until it grew past it, and status would show a stale fleet with no error.
        """
        last, created = await self.bus.stream_head(stream)
        folded = self.cursor.positions.get(stream, 0)
        known = self.cursor.stream_created.get(stream)
        if known is not None and created and known != created:
            why = f"it was created at {created}, and what is folded here came from one created at {known}"
        elif folded > last:
            why = f"{folded:,} of its messages are folded here, but it ends at sequence {last:,}"
        else:
            if created:
                self.cursor.stream_created[stream] = created
            return
        where = f"{self.store.path} is" if self.store is not None else "this fold is"
        raise ProjectionError(
            f"{stream} is not the stream {where} projected from: {why} (deleted and declared again, or "
            "restored from an older backup). Move the file away and start the projector again (`llmgw project`, "
            "or `llmgw up`) to rebuild it from what the streams hold now"
        )

    async def _complete(self) -> None:
        """Fold what an older checkpoint lacks (history, the services' memory) up to its cursor, once."""
        if not self._incomplete:
            return
        log.info("the checkpoint predates fold version %d: folding the models' history and the services' "
                 "memory up to its position once", FOLD_VERSION)
        from llmgw.fleet.replay import replay

        again = await replay(self.bus, upto=self.cursor.positions, use_snapshots=False)
        # Everything but the projector's own fold and positions (which its DuckDB rows derive from)
        # comes from the replay: whatever a later version adds to the checkpoint comes along.
        for rid, replica in self.state.replicas.items():  # where each was placed: checked by snapshot readers
            if (folded := again.state.replicas.get(rid)) is not None:
                replica.placed_seq, replica.endpoint_seq = folded.placed_seq, folded.endpoint_seq
        again.state, again.cursor = self.state, self.cursor
        self.checkpoint = again
        self._incomplete = False

    async def _catch_up(self, stops: dict[str, int]) -> None:
        """Fold what the streams hold up to ``stops`` in windows of the server's stored time, retried
        from what was folded when the server is busy or restarting.

        Each window is folded whole before anything is committed or snapshotted, so every fold
        snapshot written during a rebuild stands at a moment that existed, and serves
        ``ctl status --at`` for any moment after it.
        """
        await self._retrying("catching up", lambda: self._catch_up_once(stops), self.streams)

    async def _catch_up_once(self, stops: dict[str, int]) -> None:
        readers = {}
        for stream in self.streams:
            await self._check_same_stream(stream)
            start, stop = self.cursor.positions.get(stream, 0) + 1, stops.get(stream, 0)
            if start <= stop:
                readers[stream] = self.bus.reader(stream, start, batch=self.read_batch, stop_at=stop)
        if not readers:
            return
        async with contextlib.aclosing(windows(readers)) as merged:  # type: ignore[type-var]
            async for window in merged:
                while window:  # cut where a fold snapshot falls due (``_till_fold_snapshot``)
                    head, window = split_window(window, self._till_fold_snapshot())
                    for stream, msgs in head:
                        self.ingest(stream, msgs)
                    await self._maybe_commit()

    async def _read_from_position(self, stream: str, stop_at: int | None) -> None:
        await self._check_same_stream(stream)
        start = self.cursor.positions.get(stream, 0) + 1
        if stop_at is not None and start > stop_at:
            return
        reader = self.bus.reader(stream, start, batch=self.read_batch, stop_at=stop_at)
        async with contextlib.aclosing(reader.batches()) as batches:  # type: ignore[type-var]
            async for msgs in batches:
                self.ingest(stream, msgs)
                await self._maybe_commit()

    async def run_once(self) -> Checkpoint:
        """Fold every stream up to what is stored now, commit, return the state and cursor.

        (A fold up to a moment or a sequence is ``llmgw.fleet.replay``'s, in memory.)
        """
        stops = {stream: await self.bus.stream_last_seq(stream) for stream in self.streams}
        self._total = sum(max(0, seq - self.cursor.positions.get(k, 0)) for k, seq in stops.items())
        try:
            await self._complete()
            with fewer_gc_passes():
                await self._catch_up(stops)
            await self.flush()
        finally:
            # After a failed read, commits still queued finish (each a whole prefix). The read's
            # error is the one raised; one of theirs is read here rather than left in a future.
            with contextlib.suppress(Exception):
                await self._settle(0)
            self.close()
        return self.checkpoint

    async def run_forever(self, *, serve_status: bool = True) -> None:
        """Follow every stream, commit on an interval, serve status; until cancelled."""
        sub = await self.bus.serve(subjects.STATUS, self.handle_status) if serve_status else None
        ticker = asyncio.create_task(self._tick())
        self.gpu_samples = gpuuse.GpuSamples(self.bus) if serve_status else None
        samples = asyncio.create_task(self.gpu_samples.run()) if self.gpu_samples else None
        try:
            await self._complete()
            with fewer_gc_passes():
                # What is stored already, in time order; then each stream as it comes (live, that is time order).
                await self._catch_up({s: await self.bus.stream_last_seq(s) for s in self.streams})
                await _all_or_none(self._read(stream, None) for stream in self.streams)
        finally:
            await gpuuse.stop(samples)
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError, ProjectionError):
                await ticker  # a commit that failed on the ticker is raised by the flush below too
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            with contextlib.suppress(ProjectionError):
                await asyncio.shield(self.flush())
            self.close()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.commit_interval_s)
            await self._maybe_commit()

    async def handle_status(self, data: bytes) -> bytes:
        """The status service: a StatusRequest in, the StatusReport of the folded state out."""
        req = m.STATUS_REQUEST_DECODER.decode(data) if data.strip() else m.StatusRequest()
        await self.caught_up(req.wait_for, req.wait_s)
        # What the fold forgets (stopped replicas' GPU-hours, a model's latest events), noted beside it.
        history = self.history if subjects.STREAM_CONTROL in self.streams else None
        if history is not None and self._incomplete:
            raise ProjectionError("the status service is folding the models' history once after an upgrade; "
                                  "ask again in a few seconds, or use --replay")
        report = status_report.report(self.state, req.now, req.idle_threshold_s, self.cursor, history=history,
                                      replicas=req.replicas, model=req.model)
        report = gpuuse.add_to(report, self.state, self.gpu_samples, nodes=req.gpus)
        if req.usage_by:
            report = msgspec.structs.replace(report, usage=await self.usage(req.usage_by, req.usage_days))
        return m.encode(report)

    async def usage(self, by: str, since_days: int) -> m.UsageTable | None:
        """``ctl usage`` from this projector's file, once what it has folded is committed; None without a file.

        The question goes to the writer (thread or process) behind the commit of everything folded when
        it was asked, so the rows hold at least ``positions``: what the analysts' copy has only a minute later.
        """
        if self.store is None or self._pool is None:
            return None
        positions = dict(sorted(self.cursor.positions.items()))
        await self.commit()
        loop = asyncio.get_running_loop()
        rows = await loop.run_in_executor(self._pool, self._usage_rows, by, since_days)
        return m.UsageTable(by=by, since_days=since_days, positions=positions,
                            rows=tuple(m.UsageRow(name=r[0] if r[0] is not None else "", requests=r[1], errors=r[2],
                                                  throttled=r[3], forbidden=r[4], prompt_tokens=r[5],
                                                  completion_tokens=r[6], cached_tokens=r[7]) for r in rows))

    def _usage_rows(self, by: str, since_days: int) -> list[tuple[Any, ...]]:
        """On the writer thread, after the commits queued before it."""
        if self._write_failed is not None:
            raise ProjectionError(f"the projector's file is not being written ({self._write_failed})")
        if self._process is not None:
            return self._process.usage(by, since_days)
        assert self.store is not None
        return self.store.usage(by, since_days)

    async def caught_up(self, seqs: dict[str, int], within_s: float) -> None:
        """Return once every stream named is folded up to its sequence; ProjectionError after ``within_s``."""
        missing = sorted(s for s, seq in seqs.items() if s in subjects.HISTORY_STREAMS and s not in self.streams and seq)
        if missing:
            raise ProjectionError(f"this projector does not follow {', '.join(missing)}, so it cannot say what was "
                                  "stored there: use --replay, or a projector that follows every history stream")
        seqs = {s: seq for s, seq in seqs.items() if s in self.streams}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while behind := {s: seq for s, seq in seqs.items() if self.cursor.positions.get(s, 0) < seq}:
            left = deadline - loop.time()
            if left <= 0:
                lag = ", ".join(f"{s} {self.cursor.positions.get(s, 0)} of {seq}" for s, seq in sorted(behind.items()))
                raise ProjectionError(f"the projector has not yet folded what was stored when you asked ({lag}) "
                                      f"after {within_s:g}s; it is catching up: ask again, or use --replay")
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._progress.wait()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._process is not None:
            self._process.close()
            self._process = None
