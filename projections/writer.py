"""The projector's DuckDB writer in a child process, so DuckDB never takes the reading loop's GIL.

Reading NATS, decoding and folding are Python on one core; the appender's
conversions and the commit are the other half of the work. In a thread they
share one GIL and the reader waits; in a child process they run on the second
core. The child owns the DuckDB file (one writer per file) and dies with its
parent (PR_SET_PDEATHSIG), so a killed projector never leaves a half-commit
running or the file locked. It shares the projector's process group, so it
ignores SIGINT and SIGTERM sent to the group (``llmgw up`` stopping it): the
projector commits what it folded and then closes the pipe, which ends it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec

from llmgw.errors import ProjectionError
from llmgw.proc import die_with_parent
from llmgw.projections.store import Batch, Raw, Store

# What goes down the pipe per commit: (rows per staging table, raw columns per stream, events, state); the
# child joins the columns into chunks (``Batch.pack``), off the reading process's core.
# msgpack, not pickle: a busy week's idle history is millions of short rows, and
# msgspec encodes them five times faster.
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(tuple[dict[str, list[tuple]], dict[str, Raw], int, bytes])
# A question the status service asks of the file between commits (``ctl usage``): this byte, then (by, days).
_QUERY = b"?"
_QUERY_DECODER = msgspec.msgpack.Decoder(tuple[str, int])


# The fold bounds a projection: the reading process is one core of Python, and nats-server must run to feed
# it. The writer has commits in hand to spare (two in flight), so it yields the cores to them (nice) and
# takes one itself (one DuckDB thread: on two cores a second one preempts the reader, and its threads'
# waits cost CPU). One thread commits ~50k events/s here, more than the reader folds (issue 46).
WRITER_NICE = 10
WRITER_THREADS = 1
_STOPS = {signal.SIGINT, signal.SIGTERM}  # what `llmgw up` sends the projector's group to stop it


def _main(path: str, conn: Connection, copy_path: str | None, copy_interval_s: float) -> None:
    die_with_parent()  # Linux only; elsewhere the pipe's EOF ends the child
    for sig in _STOPS:
        signal.signal(sig, signal.SIG_IGN)  # the parent decides when to stop
    with contextlib.suppress(OSError):
        os.nice(WRITER_NICE)
    try:
        store = Store(path, threads=WRITER_THREADS)
    except ProjectionError as e:
        conn.send(str(e))
        return
    conn.send(None)
    last_copy = 0.0
    try:
        while True:
            try:
                data = conn.recv_bytes()
            except EOFError:
                return
            if not data:
                return
            if data[:1] == _QUERY:
                by, days = _QUERY_DECODER.decode(data[1:])
                try:
                    conn.send(("rows", store.usage(by, days)))
                except Exception as e:  # noqa: BLE001 - reported to the parent, which answers with it
                    conn.send(f"{e}")
                continue
            rows, raw, events, checkpoint = _DECODER.decode(data)
            try:
                store.commit(Batch(rows=rows, raw=raw, events=events), checkpoint)
                if copy_path and time.monotonic() - last_copy >= copy_interval_s:
                    store.export_copy(copy_path)
                    last_copy = time.monotonic()
            except Exception as e:  # noqa: BLE001 - reported to the parent, which stops
                conn.send(f"{e}")
            else:
                conn.send(None)
    finally:
        store.close()


class ProcessWriter:
    """Commits batches in a child process that owns the DuckDB file."""

    def __init__(self, path: str | Path, copy_path: str | Path | None, copy_interval_s: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_main, args=(str(path), child, str(copy_path) if copy_path else None, copy_interval_s),
            name="llmgw-duckdb-writer", daemon=True,
        )
        # A stop sent to the group while the child's Python starts would end it before _main ignores it:
        # ignored across the spawn (SIG_IGN survives fork and exec), as only the main thread may set it;
        # elsewhere the start is waited for here, as before (issue 46 moved that wait to the first batch).
        ignoring = threading.current_thread() is threading.main_thread()
        kept = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _STOPS} if ignoring else {}
        try:
            self._proc.start()
        finally:
            for sig, handler in kept.items():
                signal.signal(sig, handler)
        child.close()
        # Its start (a Python that imports DuckDB and opens the file: ~0.3 s) is waited for at the first
        # batch, not here: the reader folds meanwhile, on the other core.
        self._started = False
        if not ignoring:
            self._ready()

    def _ready(self) -> None:
        if not self._started:
            self._check(timeout=60)
            self._started = True

    def _check(self, timeout: float | None = None) -> None:
        if timeout is not None and not self._conn.poll(timeout):
            raise ProjectionError(f"the DuckDB writer process did not start within {timeout:.0f}s")
        try:
            err = self._conn.recv()
        except (EOFError, OSError) as e:  # OSError: ConnectionResetError when it died with our batch unread
            raise self._died() from e
        if err is not None:
            raise ProjectionError(err)

    def _died(self) -> ProjectionError:
        self._proc.join(timeout=1)
        return ProjectionError(f"the DuckDB writer process died (exit {self._proc.exitcode}); "
                               "the last commit is intact, restart the projector")

    def commit(self, batch: Batch, checkpoint: bytes) -> None:
        """Send one batch and wait for its commit (called from the projector's writer thread)."""
        self._ready()
        try:
            self._conn.send_bytes(_ENCODER.encode((batch.rows, batch.raw, batch.events, checkpoint)))
        except OSError as e:  # BrokenPipeError, ConnectionResetError: nobody reads the pipe any more
            raise self._died() from e
        self._check()

    def usage(self, by: str, since_days: int) -> list[tuple]:
        """``Store.usage`` in the child, after every commit sent before (called from the writer thread)."""
        self._ready()
        try:
            self._conn.send_bytes(_QUERY + _ENCODER.encode((by, since_days)))
            reply = self._conn.recv()
        except (EOFError, OSError) as e:
            raise self._died() from e
        if isinstance(reply, str):
            raise ProjectionError(reply)
        return list(reply[1])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send_bytes(b"")
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()
