"""One request you can trace: its id in every answer and to the engine, and one line in the access log.

* **The id.** A client's ``x-request-id`` when it is one (``REQUEST_ID_PATTERN``: 1 to 128 of
  letters, digits and ``._:/+=@-``), else a new one (32 hex digits): an id that could break a
  header, a log line or a shell is replaced, never passed on. Every answer carries it as
  ``x-request-id`` (stamped by ``routes`` on every answer it is given, by ``gateway`` on a stream's head), an error's
  body as ``error.request_id``, and the engine gets it as ``X-Request-Id`` (vLLM and
  llama-server take it).
* **The line.** For each request on an OpenAI route, one JSON line (``messages.AccessLine``):
  the gateway notes what it learns on the request's ``Trace`` (on its ``Call``), and the front
  (``routes``) writes the line once the answer's last byte is out. ``AccessLog`` hands lines to a writer
  thread through a bounded queue, so the event loop never waits on a slow disk; past
  ``MAX_PENDING`` lines waiting (a disk that stalled), new ones are dropped and counted.
  ``reopen`` (SIGUSR1, for logrotate) makes the thread reopen the file before its next write.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import queue
import re
import sys
import threading
import time
from concurrent.futures import Future
from datetime import UTC, datetime
from typing import IO, TYPE_CHECKING, Any

import msgspec
from aiohttp import web
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from llmgw import messages as m
from llmgw.errors import ConfigError
from llmgw.messages.usage import ANONYMOUS_CALLER

if TYPE_CHECKING:
    from llmgw.router.metrics import Usage
    from llmgw.router.quotas import Reservation
    from llmgw.router.spans import Spans

log = logging.getLogger(__name__)

HEADER = "x-request-id"
MAX_PENDING = 100_000  # lines waiting for the disk before new ones are dropped (about 40 MB)
_VALID = re.compile(m.REQUEST_ID_PATTERN)
_ENC = msgspec.json.Encoder()
_ERROR_BODY_MAX = 64 * 1024  # larger bodies are not an error document of ours or an engine's: left as they are


def request_id(given: str | None) -> str:
    """The client's id when it is a valid one, else a new one."""
    if given and len(given) <= m.REQUEST_ID_MAX and _VALID.match(given):
        return given
    return os.urandom(16).hex()  # what uuid4().hex draws, without building a UUID per request


class Trace:
    """What one request's line will say, noted as its path learns it (times from ``t0``, perf_counter)."""

    __slots__ = ("at_ns", "engine_ms", "error", "id", "logged", "model", "queue_s", "replica",
                 "replica_span", "span", "spans", "status", "stream", "t0", "ttft_s", "usage", "wake_s")

    def __init__(self, rid: str, spans: Spans | None = None) -> None:
        self.id = rid
        self.at_ns = time.time_ns()
        self.t0 = time.perf_counter()
        self.model = ""
        self.replica = ""
        self.status = 0
        self.stream = False
        self.error = ""
        self.usage: tuple[int, int, int] | None = None  # prompt, completion, cached
        self.queue_s = 0.0
        self.wake_s = 0.0
        self.ttft_s = -1.0
        self.logged = False  # an OpenAI route's request: ``ended`` says so, and the line is written
        self.spans = spans  # with --otlp-endpoint: its spans (llmgw/router/spans.py), begun when first needed
        self.span: Any = None
        self.replica_span: Any = None
        self.engine_ms: dict[str, float] = {}  # what the engine said its parts took (llama-server's timings)

    @property
    def at(self) -> datetime:
        """When the request came (made only for a line that is written: most requests' traces are not read)."""
        return datetime.fromtimestamp(self.at_ns / 1e9, UTC)

    def counted(self, usage: Usage) -> None:
        """The engine's ``usage`` (and its timings, when it gave them)."""
        self.usage = (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        if usage.timings is not None:
            self.engine_ms = {"prompt_ms": usage.timings.prompt_ms, "predicted_ms": usage.timings.predicted_ms}

    def first_byte(self) -> None:
        """The engine's first byte (a stream's first chunk comes after its head, and wins)."""
        self.ttft_s = time.perf_counter() - self.t0

    def ended(self, model: str, stream: bool, status: int) -> None:
        self.model, self.stream, self.status, self.logged = model, stream, status, True


class Call:
    """One request's state, as its path learns it: its trace, its key, the tokens it holds, its adapter's load.

    One slotted object, made once per request, passed along: not aiohttp's request mapping, whose
    every ``get`` is a Python call through ``Mapping.get``.
    """

    __slots__ = ("hold", "key", "lora_in", "lora_load", "trace")

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.key: m.KeyDeclared | None = None  # the declared key it came with (the gateway's ``_authorized``)
        self.hold: Reservation | None = None  # a keyed request's tokens held (``quotas.reserve``)
        self.lora_in = True  # whether the body it sends may hold a ``lora`` field
        self.lora_load: dict[str, str] | None = None  # the adapter load it waited for (``x-llmgw-adapter-load-ms``)


def with_request_id(resp: web.StreamResponse, rid: str) -> str:
    """Put ``rid`` in an unsent error document's ``error`` (ours or an engine's); return the error's code."""
    if resp.status < 400 or not isinstance(resp, web.Response) or not isinstance(resp.body, bytes):
        return ""
    if len(resp.body) > _ERROR_BODY_MAX or not resp.content_type.endswith("json"):
        return ""
    try:
        doc = msgspec.json.decode(resp.body)
    except msgspec.DecodeError:
        return ""
    err = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(err, dict):
        return ""
    err["request_id"] = rid
    resp.body = _ENC.encode(doc)
    code = err.get("code")
    kind = err.get("type")
    return code if isinstance(code, str) else kind if isinstance(kind, str) else ""


def stamp_unrouted(resp: web.StreamResponse) -> web.StreamResponse:
    """An answer made before any route ran (a request the parser refused): a new id, in head and body."""
    rid = request_id(None)
    with_request_id(resp, rid)
    resp.headers[HEADER] = rid
    return resp


def _who(request: web.BaseRequest, key: m.KeyDeclared | None, static_keys: bool, status: int) -> tuple[str, str]:
    """Who asked, never a secret: a declared key's name and tenant, an --api-keys key's digest prefix, or ``-``."""
    if key is not None:
        return key.name, key.tenant
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    token = token.strip()
    if static_keys and status != 401 and scheme.lower() == "bearer" and token:
        return "sha256:" + hashlib.sha256(token.encode()).hexdigest()[:12], ""
    return ANONYMOUS_CALLER, ""


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def line_of(call: Call, request: web.BaseRequest, router: str, static_keys: bool) -> m.AccessLine:
    """The access-log line of a request once answered (what its spans end with too)."""
    tr = call.trace
    key, tenant = _who(request, call.key, static_keys, tr.status)
    prompt, completion, cached = tr.usage or (0, 0, 0)
    return m.AccessLine(at=tr.at, id=tr.id, router=router, route=request.path[:256], caller=key[:256],
                        tenant=tenant, model=tr.model[:256], replica=tr.replica, status=tr.status,
                        stream=tr.stream, error=tr.error[:256], prompt_tokens=prompt, completion_tokens=completion,
                        cached_tokens=cached, queue_ms=_ms(tr.queue_s), wake_ms=_ms(tr.wake_s),
                        ttft_ms=_ms(tr.ttft_s) if tr.ttft_s >= 0 else -1.0,
                        total_ms=_ms(time.perf_counter() - tr.t0))


# --- the writer ------------------------------------------------------------------------

_REOPEN, _STOP = object(), object()


class AccessLog:
    """``--access-log FILE|-``: lines queued here, written by one thread, so a slow disk never stalls a request."""

    def __init__(self, path: str, max_pending: int = MAX_PENDING) -> None:
        self.path = path
        self.dropped = 0  # lines not written: the queue was full, or the disk refused them
        self._warned = 0  # the drops the router's log has been told of
        self._queue: queue.Queue[Any] = queue.Queue(max_pending)
        self._file: IO[bytes] | None = None
        self._thread: threading.Thread | None = None

    def open(self) -> None:
        """Open the file now (a path that cannot be written to is a ConfigError at start) and start the thread."""
        self._file = self._opened()
        self._thread = threading.Thread(target=self._run, name="router-access-log", daemon=True)
        self._thread.start()

    def _opened(self) -> IO[bytes]:
        if self.path == "-":
            return sys.stdout.buffer
        try:
            return open(self.path, "ab")  # noqa: SIM115 - the writer thread owns it until close()
        except OSError as e:
            raise ConfigError(f"cannot open the access log {self.path} ({e.strerror}); give --access-log a file "
                              "in a directory you can write, or - for standard output") from e

    def write(self, line: m.AccessLine) -> None:
        """Queue one line; never waits (a full queue drops it, counted)."""
        try:
            self._queue.put_nowait(_ENC.encode(line) + b"\n")
        except queue.Full:
            self.dropped += 1

    def reopen(self) -> None:
        """Reopen the file before the next write (SIGUSR1, after logrotate moved it)."""
        self._queue.put(_REOPEN)

    async def flush(self) -> None:
        """Wait until every line queued so far is written (tests, and the router's stop)."""
        if self._thread is None:
            return
        done: Future[None] = Future()
        self._queue.put(done)
        await asyncio.wrap_future(done)

    async def close(self) -> None:
        if self._thread is None:
            return
        await self.flush()
        self._queue.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:  # everything queued meanwhile goes in the same write
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            lines: list[bytes] = []
            for item in batch:  # in order: a line queued after a reopen goes to the new file
                if isinstance(item, bytes):
                    lines.append(item)
                    continue
                if lines:
                    self._write(b"".join(lines), len(lines))
                    lines = []
                if item is _REOPEN:
                    self._reopen()
                elif isinstance(item, Future):
                    item.set_result(None)
                elif item is _STOP:
                    if self._file is not None and self._file is not sys.stdout.buffer:
                        self._file.close()
                    self._file = None
                    return
            if lines:
                self._write(b"".join(lines), len(lines))
            if self.dropped > self._warned:  # told here, once a batch: the loop that dropped them never logs
                log.warning("access log %s: %d lines dropped so far (the disk did not keep up, or refused them)",
                            self.path, self.dropped)
                self._warned = self.dropped

    def _write(self, data: bytes, n: int) -> None:
        try:
            if self._file is None:
                self._file = self._opened()
            self._file.write(data)
            self._file.flush()
        except (OSError, ConfigError) as e:
            self.dropped += n
            log.warning("access log %s: %d lines not written (%s)", self.path, n, e)

    def _reopen(self) -> None:
        if self.path == "-":
            return
        if self._file is not None:
            try:
                self._file.close()
            except OSError as e:
                log.warning("access log %s: closing it to reopen failed (%s)", self.path, e)
        self._file = None
        try:
            self._file = self._opened()
        except ConfigError as e:
            log.warning("access log %s: %s; trying again at the next line", self.path, e)


class DroppedCollector(Collector):
    """``llmgw_router_access_log_dropped_total``, read from the log at scrape time."""

    def __init__(self, access: AccessLog) -> None:
        self.access = access

    def describe(self) -> list[CounterMetricFamily]:
        return []

    def collect(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily("llmgw_router_access_log_dropped",
                                    "Access-log lines not written: the queue to the disk was full, or the disk "
                                    "refused them.", value=self.access.dropped)]
