"""The router: an OpenAI-compatible gateway that knows whether anyone wants a replica.

Three rooms, by how often their code runs, and this module composes them:

* ``gateway.Gateway``, once per request: its key, its quota, its slot, its replica,
  the engine's answer piped back, what it used counted (and /v1/models, /health,
  /metrics). A request's whole path is that one object.
* ``ticks.Ticks``, once per tick: the idle map and what it carries, the recall of
  this router's own last map at start, the usage stream followed for the quotas.
* ``wake.Wake``, only while a model is parked: the held requests, the wish, the
  router's part of the cold-start ledger.

Here the settings are checked, the rooms wired (what two rooms share is made here
and handed to both: the pool, the idle tracker, the prefix homes), the loops started
and stopped, and the listener kept with its connections: a request aiohttp's parser
refuses is answered the router's way, and every unreadable request is logged here,
once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from aiohttp import http_exceptions, web

from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.clientsockets import ClientSockets, CountedConnection, unreadable
from llmgw.engine.upstream import Timeouts, Upstream
from llmgw.errors import ConfigError, LlmgwError
from llmgw.router import access, spans
from llmgw.router import openai_api as api
from llmgw.router import prefix as prefixroute
from llmgw.router.endpoints import EndpointSink, EngineKeys, Pool, Replica
from llmgw.router.gateway import Gateway
from llmgw.router.idle import IdleFor, IdleTracker
from llmgw.router.journal import Journal
from llmgw.router.metrics import Metrics
from llmgw.router.quotas import Quotas
from llmgw.router.routes import Front
from llmgw.router.ticks import Ticks
from llmgw.router.wake import Wake

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 32 * 1024 * 1024  # engines behind take more (vLLM has no limit): the router's is the one that counts
GC_YOUNG = 10_000  # allocations between two young-generation collections in a router's process (Python's: 700)
SHUTDOWN_S = 60.0  # how long a stopping router lets answers under way finish (aiohttp's runner's default)

# Non-HTTP bytes (TLS to the HTTP port, scanners): aiohttp logs those at debug only, and so do we.
_NOT_HTTP: tuple[type[BaseException], ...] = (
    (http_exceptions.BadHttpMethod,) if hasattr(http_exceptions, "BadHttpMethod") else ()
)


class _Connection(CountedConnection):
    """aiohttp's connection, counted per client (``--max-connections-per-client``), and a request its
    parser refuses is answered the router's way.

    aiohttp answers one (a broken chunk that arrived with its headers, say) in text/plain
    before any handler runs, and logs a traceback for each: a client could fill the log at will.
    """

    def __init__(self, manager: web.Server, sockets: ClientSockets, refused: Callable[[str, str, bool], None],
                 **kwargs: Any) -> None:
        super().__init__(manager, sockets, **kwargs)
        self._refused = refused

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:  # the router's own failure: aiohttp's answer and its traceback
            return super().handle_error(request, status, exc, message)
        reason = unreadable(exc, message)
        self._refused(request.remote or "?", reason, isinstance(exc, _NOT_HTTP))
        resp = api.error(status, f"the request could not be read: {reason}", "invalid_request_error",
                         "malformed_request")
        resp.force_close()  # the parser has lost its place in the stream
        return access.stamp_unrouted(resp)


# --- the router -------------------------------------------------------------------


class Router:
    """The router's rooms wired together (gateway, ticks, wake), the loops they need, the listener."""

    def __init__(
        self,
        bus: Bus,
        name: str,
        *,
        tick_s: float = 10.0,
        api_keys: Iterable[str] = (),
        max_body_bytes: int = DEFAULT_MAX_BODY,
        timeouts: Timeouts | None = None,
        idle_tracking: bool = True,
        body_timeout_s: float = 30.0,
        wake_timeout_s: float = 120.0,
        header_timeout_s: float = 30.0,
        max_connections_per_client: int = 0,
        access_log: str | None = None,
        otlp_endpoint: str | None = None,
        tracer_provider: Any = None,
        journal: Path | None = None,
    ) -> None:
        if tick_s <= 0:
            raise ConfigError(f"--tick must be positive (got {tick_s})")
        if wake_timeout_s < 0:
            raise ConfigError(f"--wake-timeout must be 0 or more (got {wake_timeout_s})")
        if header_timeout_s <= 0:
            raise ConfigError(f"--header-timeout must be positive (got {header_timeout_s})")
        if max_body_bytes <= 0:
            raise ConfigError(f"--max-body must be positive (got {max_body_bytes} bytes)")
        if max_connections_per_client < 0:
            raise ConfigError(f"--max-connections-per-client must be 0 (no cap) or more (got {max_connections_per_client})")
        self.bus = bus
        self.name = name
        self.boot_id = uuid.uuid4().hex
        self.tick_s = tick_s
        self.keys = tuple(api_keys)
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.header_timeout_s = header_timeout_s
        self.sockets = ClientSockets(max_connections_per_client, f"router {name}")  # open sockets per client
        self.idle_tracking = idle_tracking
        # --access-log: one JSON line per request, written off the event loop (llmgw/router/access.py).
        self.access_log = access.AccessLog(access_log) if access_log else None
        # --otlp-endpoint (the otel extra): a span per request and one per replica asked (llmgw/router/spans.py);
        # a provider given (a test's) is its giver's to shut down.
        self._owns_tracer = tracer_provider is None and bool(otlp_endpoint)
        self.spans: spans.Spans | None = None
        if otlp_endpoint or tracer_provider is not None:
            self.spans = spans.Spans(tracer_provider or spans.otlp_provider(otlp_endpoint or "", name))
        self.pool = Pool()
        self.sink = EndpointSink(bus, self.pool)
        self.engine_keys = EngineKeys(bus, self.pool)  # what each engine takes as its Authorization
        self.upstream = Upstream(timeouts, keys=self.engine_keys.key_for)
        self.idle = IdleTracker()  # written per request, collected per tick; its tick count paces the wishes
        self.prefixes: dict[str, prefixroute.PrefixTable] = {}  # per model routed by prefix: homed per request, expired per tick
        self.metrics = Metrics(self.pool, lambda: self.sink.bad_events, lambda: self.ticks.idle_maps)
        if self.access_log is not None:
            self.metrics.registry.register(access.DroppedCollector(self.access_log))
        self.quotas = Quotas(name)  # per key: requests a minute, tokens a day, this router's and the others'
        self.wake = Wake(bus=bus, name=name, boot_id=self.boot_id, pool=self.pool, sink=self.sink, metrics=self.metrics,
                         idle=self.idle, tick_s=tick_s, timeout_s=wake_timeout_s)
        self.sink.on_change = self.wake.pool_changed  # held requests go on (or are refused) as the pool changes
        # What the next map will carry, on disk as it is counted: a crash then loses none of it (journal.py).
        # Without idle maps nothing would ever cut it.
        self.journal = Journal(journal) if journal is not None and idle_tracking else None
        self.ticks = Ticks(bus=bus, name=name, boot_id=self.boot_id, pool=self.pool, sink=self.sink, quotas=self.quotas,
                           idle=self.idle, prefixes=self.prefixes, wake=self.wake, tick_s=tick_s, journal=self.journal)
        self.gateway = Gateway(bus=bus, name=name, boot_id=self.boot_id, pool=self.pool, sink=self.sink,
                               metrics=self.metrics, upstream=self.upstream, quotas=self.quotas, wake=self.wake,
                               idle=self.idle, prefixes=self.prefixes, key_use=self.ticks.key_use,
                               cache_use=self.ticks.cache_use, refused=self._refused, keys=self.keys,
                               max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s,
                               idle_tracking=idle_tracking)
        # The rooms' state under the names the router has always had: the same objects, not copies.
        self.waiting = self.wake.waiting
        self.wakes = self.wake.ledger
        self._key_use = self.ticks.key_use
        self._tasks: list[asyncio.Task[None]] = []
        self._server: web.Server | None = None
        self._listener: asyncio.Server | None = None
        self.url = ""

    # --- what the rooms do, as the router's own -------------------------------------

    def acquire(self, model: str, exclude: Replica | None = None, key: int | None = None) -> Replica | None:
        """A healthy replica of ``model`` for a request, or None; never awaits (``Gateway.acquire``)."""
        return self.gateway.acquire(model, exclude, key)

    def release(self, rep: Replica) -> None:
        self.gateway.release(rep)

    def routing_key(self, model: str, route: str, body: bytes | api.Head) -> int | None:
        """The prompt's key when ``model`` routes by prefix (its declaration says so), else None."""
        return self.gateway.routing_key(model, route, body)

    def idle_for(self, replica_id: str, now: float | None = None) -> IdleFor:
        return self.idle.idle_for(replica_id, time.time() if now is None else now)

    async def publish_idle_map(self) -> m.IdleMapPublished:
        """Publish this tick's idle map now (and a wish for each model still waiting); return the map."""
        return await self.ticks.publish_idle_map()

    def _queued(self) -> dict[str, int]:
        return self.wake.queued()

    @property
    def wishes(self) -> int:
        """Wishes (``ModelWanted``) this router published."""
        return self.wake.wishes

    @property
    def idle_maps(self) -> int:
        """Idle maps this router published."""
        return self.ticks.idle_maps

    @property
    def wake_timeout_s(self) -> float:
        """How long a request is held for its model to wake."""
        return self.wake.timeout_s

    @wake_timeout_s.setter
    def wake_timeout_s(self, seconds: float) -> None:
        self.wake.timeout_s = seconds

    # --- lifecycle ----------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, wait_caught_up: float = 10.0) -> str:
        """Follow the control stream, start ticking, listen; returns the base URL."""
        if self.access_log is not None:
            self.access_log.open()  # a log it cannot write is refused before anything starts
        await self.upstream.start()
        await self.ticks.take_up_journal()  # before any map of this boot: its first one carries them
        # The pool keeps routing to what it knew meanwhile; the sink resumes where it stopped.
        self._tasks.append(asyncio.create_task(self._retrying("control stream", self.sink.run), name="router-endpoints"))
        self._tasks.append(asyncio.create_task(self._retrying("engine keys", self.engine_keys.run), name="router-keys"))
        self._tasks.append(asyncio.create_task(self._retrying("usage stream", self.ticks.follow_usage),
                                               name="router-usage"))
        if self.idle_tracking:
            self._tasks.append(asyncio.create_task(self.ticks.run(), name="router-idle"))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_caught_up):
                await self.sink.caught_up.wait()
                await self.engine_keys.caught_up.wait()  # an endpoint it routes to, it can reach
                await self.ticks.usage_caught_up.wait()  # a key's day and minute, before its first request
        if self.idle_tracking:
            await self.ticks.recall()
        # aiohttp's low-level server, one handler (routes.Front): no Application, router, middleware or signal.
        # handler_cancellation: a client that goes away cancels the upstream request.
        loop = asyncio.get_running_loop()
        front = Front(self.gateway, self.access_log, self.name, bool(self.keys), self.spans)
        server = self._server = web.Server(front, handler_cancellation=True, loop=loop)

        def connection() -> _Connection:
            # keepalive_timeout: aiohttp closes a connection that has not sent a whole request
            # head this long after it opened (or after its last answer), so headers sent a line
            # every few seconds (slow-loris) cannot hold sockets for aiohttp's default hour.
            return _Connection(server, self.sockets, self._refused, loop=loop, access_log=None,
                               keepalive_timeout=self.header_timeout_s)

        try:
            self._listener = await loop.create_server(connection, host, port, backlog=1024)
        except OSError as e:
            await self.stop()
            raise ConfigError(f"router cannot listen on {host}:{port} ({e.strerror}); pick another --listen") from e
        bound = self._listener.sockets[0].getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{bound}"
        return self.url

    async def stop(self) -> None:
        """Stop serving; a last idle map carries the requests since the last tick."""
        if self.idle_tracking and self.url and not self.bus.closed:
            try:
                await self.ticks.publish_last()
            except LlmgwError as e:
                log.warning("router %s: last idle map not published: %s", self.name, e)
        self.url = ""
        for t in self._tasks:
            t.cancel()
        await self.wake.stop()  # held requests answer "stopping"; wishes in flight end
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        if self._listener is not None:
            self._listener.close()  # no new connections; the runner's cleanup closes the open ones
            self._listener = None
        if self._server is not None:  # as aiohttp's runner does: idle connections closed, answers finished
            await asyncio.sleep(0)
            self._server.pre_shutdown()
            await self._server.shutdown(SHUTDOWN_S)
            self._server = None
        await self.upstream.close()
        if self.access_log is not None:
            await self.access_log.close()  # after the last request's line
        if self.spans is not None and self._owns_tracer:
            self._owns_tracer = False  # once: a second stop has nothing left to export
            await asyncio.to_thread(self.spans.shutdown)  # the last batch exported
        if self.journal is not None:
            self.journal.close()

    async def _retrying(self, what: str, read: Callable[[], Awaitable[None]]) -> None:
        """``read`` until cancelled: after a bus error, again a second later, from where it stopped."""
        while True:
            try:
                await read()
            except LlmgwError as e:
                log.warning("router %s: %s: %s; retrying", self.name, what, e)
                await asyncio.sleep(1.0)

    def _refused(self, remote: str, reason: str, quiet: bool) -> None:
        """A request the router could not read: counted, and one line in the log."""
        self.metrics.error("", "bad_request")
        (log.debug if quiet else log.warning)("router %s: unreadable request from %s: %s", self.name, remote, reason)


async def serve_router(bus: Bus, name: str, host: str, port: int, **kwargs: object) -> None:
    """Run a router until cancelled (the CLI's and ``llmgw up``'s entry point)."""
    # The router's own process: with 64 requests in flight it holds thousands of young containers
    # (aiohttp's requests, parsers, futures, each request's own), and at Python's 700 a gen0 collection
    # ran every few requests and walked them all again: tens of µs a request at c=64 (docs/benchmarks.md,
    # issue 46). At 10,000 most die by their count before a collection sees them.
    gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])
    router = Router(bus, name, **kwargs)  # type: ignore[arg-type]
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    # SIGTERM (a supervisor stopping us) ends as cleanly as Ctrl-C: the last map is published.
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    if router.access_log is not None:  # logrotate's postrotate: `kill -USR1` reopens the access log
        loop.add_signal_handler(signal.SIGUSR1, router.access_log.reopen)  # before the URL: `up` waits for it
    url = await router.start(host, port)  # (a start that fails has stopped what it started)
    # What the router holds once started (modules, the pool and keys caught up) mostly lives as long as it:
    # set aside from the collector (freed by its count all the same), a full collection walks only what
    # came after, so its pause does not grow with the number of keys.
    gc.freeze()
    try:
        print(url, flush=True)
        await stopping.wait()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        loop.remove_signal_handler(signal.SIGUSR1)
        await router.stop()
