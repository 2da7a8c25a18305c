"""Where the projector's time goes: each stage on its own, with no NATS in the loop.

    .venv/bin/python benchmarks/projector_stages.py                  # 1M events (as replay.py)
    .venv/bin/python benchmarks/projector_stages.py --events 300000

Publishes the replay benchmark's history to an embedded nats-server, reads it
all into memory with ``Bus.reader``, then measures per event: decode + fold per
stream, the same with history collected for DuckDB, and ``Store.commit`` of
60k-event batches with the time of every statement. Prints figures; asserts
nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from replay import history, publish  # noqa: E402

from llmgw import subjects  # noqa: E402
from llmgw.bus import Bus, RawMsg  # noqa: E402
from llmgw.bus.server import EmbeddedServer  # noqa: E402
from llmgw.config import Settings  # noqa: E402
from llmgw.fleet.fold import Checkpoint, encode  # noqa: E402
from llmgw.projections import store as S  # noqa: E402
from llmgw.projections.runner import Projector  # noqa: E402

COMMIT_EVERY = 60_000


async def load(work: Path, events: int) -> dict[str, list[list[RawMsg]]]:
    server = EmbeddedServer(work / "nats", port=0)
    server.start()
    try:
        bus = await Bus.connect(Settings(nats_url=server.url, request_timeout_s=30.0), "llmgw-bench-stages")
        await bus.ensure_streams()
        await publish(bus, history(events, 256, 8, 7, 2, 10.0, 48, 6), 10_000)
        await asyncio.sleep(2)  # let JetStream store what the flushes handed it
        out: dict[str, list[list[RawMsg]]] = {}
        for stream in subjects.HISTORY_STREAMS:
            last = await bus.stream_last_seq(stream)
            out[stream] = [b async for b in bus.reader(stream, 1, batch=8192, stop_at=last).batches()]
        await bus.close()
        return out
    finally:
        server.stop()


def projector(with_history: bool) -> Projector:
    """A Projector that only folds: no bus, no writer (``ingest`` needs neither)."""
    p = Projector.__new__(Projector)
    p.checkpoint = Checkpoint()
    p.state, p.cursor, p.batch, p.folded, p._total = p.checkpoint.state, p.checkpoint.cursor, S.Batch(), 0, 0
    p.store = object() if with_history else None  # type: ignore[assignment]
    p.progress, p._progress = None, asyncio.Event()
    p.fold_snapshot_events = None
    return p


class TimedConnection:
    """The store's connection, timing every statement and appender by its first line."""

    def __init__(self, con: Any, times: collections.Counter[str]) -> None:
        self._con, self._times = con, times

    def execute(self, sql: str, *args: Any) -> Any:
        if not args and sql.count(";") > 1:  # a script (the commit's INSERT … SELECTs): time each
            result = None
            for statement in sql.split(";\n"):
                if statement.strip():
                    result = self.execute(statement)
            return result
        start = time.perf_counter()
        try:
            return self._con.execute(sql, *args)
        finally:
            self._times[sql.strip().split("\n")[0][:48]] += time.perf_counter() - start

    def appender(self, table: str) -> Any:
        times, app = self._times, self._con.appender(table)

        class Timed:
            def append_rows(self, rows: list[Any]) -> None:
                start = time.perf_counter()
                app.append_rows(rows)
                times[f"appender {table}"] += time.perf_counter() - start

            def flush(self) -> None:
                start = time.perf_counter()
                app.flush()
                times[f"appender {table}"] += time.perf_counter() - start

        return Timed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._con, name)


def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-stages-", dir=args.workdir))
    try:
        data = asyncio.run(load(work, args.events))
        n = sum(len(b) for batches in data.values() for b in batches)
        print(f"{n:,} events in memory: " + ", ".join(f"{k} {sum(map(len, v)):,}" for k, v in data.items()))
        for with_history in (False, True):
            p = projector(with_history)
            for stream, batches in data.items():
                count = sum(map(len, batches))
                start = time.perf_counter()
                for b in batches:
                    p.ingest(stream, b)
                    p.batch = S.Batch()  # the commit's half is measured below
                label = "decode + fold + history" if with_history else "decode + fold"
                print(f"{label:24} {stream:14} {(time.perf_counter() - start) / count * 1e6:6.2f} µs/event")

        # The writer's half: the same events, interleaved as three readers deliver them.
        times: collections.Counter[str] = collections.Counter()
        store = S.Store(work / "stages.duckdb")
        store.con = TimedConnection(store.con, times)  # type: ignore[assignment]
        p = projector(True)
        queues = {stream: iter(batches) for stream, batches in data.items()}
        ingest = [0.0, 0.0]  # wall, CPU
        commit = [0.0, 0.0]  # wall, CPU (every thread of this process: DuckDB's too)

        def timed(into: list[float], fn: Any, *args: Any) -> None:
            w, c = time.perf_counter(), time.process_time()
            fn(*args)
            into[0] += time.perf_counter() - w
            into[1] += time.process_time() - c

        while queues:
            for stream in list(queues):
                b = next(queues[stream], None)
                if b is None:
                    del queues[stream]
                    continue
                timed(ingest, p.ingest, stream, b)
                if p.batch.events >= COMMIT_EVERY:
                    timed(commit, store.commit, p.batch, encode(p.checkpoint))
                    p.batch = S.Batch()
        timed(commit, store.commit, p.batch, encode(p.checkpoint))
        closing = time.perf_counter()
        timed(commit, store.close)
        times["close (final checkpoint)"] += time.perf_counter() - closing
        print(f"ingest (decode, fold, history): {ingest[0] / n * 1e6:.2f} µs/event wall, {ingest[1] / n * 1e6:.2f} CPU")
        print(f"Store.commit of {COMMIT_EVERY:,}-event batches and close: {commit[0] / n * 1e6:.2f} µs/event wall, "
              f"{commit[1] / n * 1e6:.2f} CPU; per statement (wall):")
        for what, secs in times.most_common():
            if secs / n * 1e6 >= 0.05:
                print(f"  {secs / n * 1e6:6.2f} µs/event  {what}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--workdir", help="where the nats store and DuckDB file go")
    main(ap.parse_args())
