"""The router: an OpenAI-compatible gateway that knows whether anyone wants a replica.

* Endpoints come from the control stream (``endpoints.EndpointSink``); only
  healthy replicas with an endpoint receive traffic.
* ``acquire`` picks the replica of the requested model with the fewest
  outstanding requests, rotating the start so ties spread the load, and
  writes the request time for idle tracking. It never awaits: on the event
  loop that makes it the critical section the seed's lock was, at no cost.
* Once a tick the router publishes one ``IdleMapPublished``; a replica with no
  request since this router started is absent from ``last_request``: unknown
  is not idle.
* Bodies pass through untouched; streams are written on chunk by chunk.
* The body limit (``--max-body``) is the router's own, checked before anything is
  forwarded: against Content-Length when there is one, and while reading otherwise
  (chunked, or decompressed from gzip). A body the router cannot read (not the
  gzip it claims, broken chunked framing) is a 400 and one log line, never a
  traceback a client could repeat at will.
* A client that leaves before its answer is written is ``client_closed``
  (status 499, as nginx logs it): its doing, not the router's, and no traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import math
import signal
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import aiohttp
import msgspec
from aiohttp import http_exceptions, web

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.clientsockets import ClientSockets, CountedConnection
from llmgw.engine.upstream import CONNECT_ERRORS, READ_ERRORS, Timeouts, Upstream
from llmgw.errors import ConfigError, LlmgwError
from llmgw.router import openai_api as api
from llmgw.router import prefix as prefixroute
from llmgw.router.endpoints import EndpointSink, Pool, Replica
from llmgw.router.idle import IdleFor, IdleTracker
from llmgw.router.metrics import Metrics, Usage, usage_of, usage_of_stream
from llmgw.router.quotas import Quotas, utc_day
from llmgw.router.wakelog import WakeLog

log = logging.getLogger(__name__)

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# Every path the router answers and its methods: anything else gets an OpenAI-style 404 or 405.
METHODS = {**dict.fromkeys(ROUTES, "POST"), "/v1/models": "GET", "/health": "GET", "/metrics": "GET"}
RETRY_AFTER_S = 5
USAGE_TAIL_BYTES = 64 * 1024  # how much of a stream's end is kept to find the engine's `usage` in
PRIORITIES = ("high", "normal", "low")  # the order a freed slot goes in (ctl key --priority)
QUEUE_PER_SLOT = 2  # requests queued per slot of a model's replicas before low ones are shed
TOKENS_MAX = 1 << 40  # the most a map carries for one replica (CacheUse's bound)
DEFAULT_MAX_BODY = 32 * 1024 * 1024  # engines behind take more (vLLM has no limit): the router's is the one that counts


_NO_SALT = "00" * 16  # for a key id nobody has: the digest is still computed (same cost)
_NO_DIGEST = "0" * 64


class KeyUseCounter:
    """One key's use of one model since the router's last published map."""

    __slots__ = ("requests", "errors", "prompt", "completion", "cached", "ttft_s", "latency_s")

    def __init__(self) -> None:
        self.requests = self.errors = self.prompt = self.completion = self.cached = 0
        self.ttft_s = self.latency_s = 0.0

    def add_request(self, status: int, seconds: float) -> None:
        self.requests += 1
        self.errors += status >= 400
        self.latency_s += seconds

    def add_tokens(self, usage: Usage) -> None:
        self.prompt += usage.prompt_tokens
        self.completion += usage.completion_tokens
        self.cached += usage.cached_tokens

    def message(self) -> m.KeyUse:
        cap = TOKENS_MAX
        return m.KeyUse(requests=min(self.requests, cap), errors=min(self.errors, cap), prompt_tokens=min(self.prompt, cap),
                        completion_tokens=min(self.completion, cap), cached_tokens=min(self.cached, cap),
                        ttft_s=min(self.ttft_s, 1e12), latency_s=min(self.latency_s, 1e12))

    def take(self, sent: m.KeyUse) -> bool:
        """Take off what a published map carried; True when nothing is left."""
        self.requests -= sent.requests
        self.errors -= sent.errors
        self.prompt -= sent.prompt_tokens
        self.completion -= sent.completion_tokens
        self.cached -= sent.cached_tokens
        self.ttft_s -= sent.ttft_s
        self.latency_s -= sent.latency_s
        return self.requests <= 0 and self.prompt <= 0 and self.completion <= 0


class _Head(msgspec.Struct):
    """The only fields the router reads from a request body."""

    model: str = ""
    stream: bool = False


class _ClientGone(Exception):  # noqa: N818 - a control-flow signal inside the router, never raised out of it
    """The client went away while its answer was being written; ``resp`` is what was begun."""

    def __init__(self, resp: web.StreamResponse) -> None:
        super().__init__("client closed the connection")
        self.resp = resp


CLIENT_CLOSED = 499  # nginx's status for a request whose client left before the answer
_HEAD = msgspec.json.Decoder(_Head)
_ENC = msgspec.json.Encoder()
_JSON = {"Content-Type": "application/json"}
# Non-HTTP bytes (TLS to the HTTP port, scanners): aiohttp logs those at debug only, and so do we.
_NOT_HTTP: tuple[type[BaseException], ...] = (
    (http_exceptions.BadHttpMethod,) if hasattr(http_exceptions, "BadHttpMethod") else ()
)


def _size_text(n: int) -> str:
    """``33554432 bytes (32 MiB)``: the exact number, and one a person reads."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n} bytes ({n / scale:g} {unit})"
    return f"{n} bytes"


def _reason(exc: BaseException | None, message: str | None = None) -> str:
    """What aiohttp's parser said about a request, on one bounded line (it quotes the client's bytes)."""
    cause = exc.__cause__ if isinstance(exc, web.RequestPayloadError) and exc.__cause__ else exc
    text = message or getattr(cause, "message", "") or str(cause or "") or type(cause).__name__
    return " ".join(str(text).split())[:200]


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
        reason = _reason(exc, message)
        self._refused(request.remote or "?", reason, isinstance(exc, _NOT_HTTP))
        resp = api.error(status, f"the request could not be read: {reason}", "invalid_request_error",
                         "malformed_request")
        resp.force_close()  # the parser has lost its place in the stream
        return resp


# --- the router -------------------------------------------------------------------


class Router:
    """The gateway: an aiohttp app, the endpoint pool, the upstream session, the idle ticker."""

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
        self.pool = Pool()
        self.sink = EndpointSink(bus, self.pool, on_change=self._pool_changed)
        self.wake_timeout_s = wake_timeout_s
        # Requests held for a model with no healthy replica, oldest first, and the
        # tick of the last wish published for each model (one per model per tick).
        self.waiting: dict[str, list[asyncio.Future[str]]] = {}
        self._wished_at_tick: dict[str, int] = {}
        self.wishes = 0
        self.wakes = WakeLog()  # the cold-start ledger's router side, published with the idle maps
        self.upstream = Upstream(timeouts)
        self.idle = IdleTracker()
        self.metrics = Metrics(self.pool, lambda: self.sink.bad_events, lambda: self.idle_maps)
        self.idle_maps = 0
        self._rr = 0
        self.prefixes: dict[str, prefixroute.PrefixTable] = {}  # per model routed by prefix
        # Per model at capacity, the requests waiting for a slot, by priority (the keys').
        self._queues: dict[str, dict[str, deque[asyncio.Future[str]]]] = {}
        self.quotas = Quotas(name)  # per key: requests a minute, tokens a day, this router's and the others'
        # Per key and model, what was asked since the last published map (ctl key; usage_by_key in DuckDB).
        self._key_use: dict[str, dict[str, KeyUseCounter]] = {}
        # Per replica answered since the last published map: [model, prompt tokens, cached tokens].
        self._cache_use: dict[str, list[Any]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._wish_tasks: set[asyncio.Task[None]] = set()
        # This router's last idle map from before this boot, read once for both _recall and _quota_start.
        self._before: tuple[int, bytes] | None = None
        self._before_read = False
        self._before_lock = asyncio.Lock()
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self.url = ""

    # --- acquire / release ------------------------------------------------------

    def acquire(self, model: str, exclude: Replica | None = None, key: int | None = None) -> Replica | None:
        """A healthy replica of ``model`` for a request, or None; never awaits.

        With a prompt ``key`` (the model routes by prefix), where that prefix is homed, within
        the load bound (llmgw/router/prefix.py); else the one with the fewest outstanding requests.
        """
        reps = self.pool.healthy.get(model)
        if not reps:
            return None
        if key is not None:
            table = self.prefixes.get(model)
            if table is None:
                table = self.prefixes[model] = prefixroute.PrefixTable()
            chosen = prefixroute.pick(table, key, reps, exclude)
            if chosen is not None:
                return self._take(chosen)
        n = len(reps)
        self._rr += 1
        start = self._rr % n
        best: Replica | None = None
        for i in range(n):
            r = reps[(start + i) % n]
            if r is not exclude and (best is None or r.outstanding < best.outstanding):
                best = r
        if best is None:
            return None
        return self._take(best)

    def _take(self, rep: Replica) -> Replica:
        rep.outstanding += 1
        if self.idle_tracking:
            self.idle.last[rep.replica_id] = time.time()
        return rep

    def routing_key(self, model: str, route: str, body: bytes) -> int | None:
        """The prompt's key when ``model`` routes by prefix (its declaration says so), else None."""
        declared = self.pool.declared.get(model)
        if declared is not None and declared.routing != "prefix":
            return None
        return prefixroute.prompt_key(route, body)

    def release(self, rep: Replica) -> None:
        rep.outstanding -= 1
        queues = self._queues.get(rep.model)
        if queues:  # a slot freed: the first request waiting, the highest priority first
            for priority in PRIORITIES:
                queue = queues[priority]
                while queue:
                    fut = queue.popleft()
                    if not fut.done():
                        fut.set_result("go")
                        return

    def _saturated(self, model: str) -> int:
        """Every healthy replica of ``model`` at its capacity: that capacity; else (or not said) 0."""
        declared = self.pool.declared.get(model)
        reps = self.pool.healthy.get(model)
        if declared is None or not declared.capacity or not reps:
            return 0
        cap = declared.capacity
        return cap if all(r.outstanding >= cap for r in reps) else 0

    async def _admit(self, model: str, priority: str) -> str:
        """Wait for a slot while every replica is full, by priority; "" once admitted, else why not.

        Below saturation nothing waits (the engines' own slots). At it, requests queue here, high
        before normal before low; past QUEUE_PER_SLOT x slots queued, a low request is refused at
        once, and a higher one takes the place of the newest lower one queued (which is refused).
        """
        cap = self._saturated(model)
        if not cap:
            return ""
        queues = self._queues.setdefault(model, {p: deque() for p in PRIORITIES})
        bound = QUEUE_PER_SLOT * cap * len(self.pool.healthy.get(model, ()))
        if sum(len(q) for q in queues.values()) >= bound:
            lower = PRIORITIES[PRIORITIES.index(priority) + 1:]
            victim = next((queues[p] for p in reversed(lower) if queues[p]), None)
            if victim is None:
                return "shed"
            victim.pop().set_result("shed")
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        queue = queues[priority]
        queue.append(fut)
        try:
            async with asyncio.timeout(self.upstream.timeouts.read_s):
                outcome = await fut
        except TimeoutError:
            outcome = "timeout"
        finally:
            if fut in queue:
                queue.remove(fut)
        return "" if outcome == "go" else outcome

    def idle_for(self, replica_id: str, now: float | None = None) -> IdleFor:
        return self.idle.idle_for(replica_id, time.time() if now is None else now)

    # --- lifecycle ----------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes)
        for route in ROUTES:
            app.router.add_post(route, self._handler(route))
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)  # model names may hold a slash (Org/Name)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.render_metrics)
        # Last, so it only takes what nothing above matched: a route-less request costs the others nothing.
        app.router.add_route("*", "/{path:.*}", self.no_route)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, wait_caught_up: float = 10.0) -> str:
        """Follow the control stream, start ticking, listen; returns the base URL."""
        await self.upstream.start()
        self._tasks.append(asyncio.create_task(self._follow(), name="router-endpoints"))
        self._tasks.append(asyncio.create_task(self._follow_usage(), name="router-usage"))
        if self.idle_tracking:
            self._tasks.append(asyncio.create_task(self._ticker(), name="router-idle"))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_caught_up):
                await self.sink.caught_up.wait()
        if self.idle_tracking:
            await self._recall()
        # handler_cancellation: a client that goes away cancels the upstream request.
        self._runner = web.AppRunner(self.app(), handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()

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

    async def _recall(self) -> None:
        """Take up this router's last idle map from before it (re)started, so idle time survives a restart.

        A restarted router knew no request, so every replica looked served-since-now ("idle 5s")
        however long nobody had asked. Its own last map says when each replica was last asked
        and since when it served those never asked; a replica it had not seen stays unknown.
        """
        try:
            got = await self._last_map_before()
        except LlmgwError as e:
            log.warning("router %s: its last idle map could not be read (%s); idle times start from now", self.name, e)
            return
        if got is None:
            return
        try:
            event = m.USAGE_DECODER.decode(got[1])
        except m.DECODE_ERRORS as e:
            log.warning("router %s: its last idle map is unreadable (%s); idle times start from now", self.name, e)
            return
        if not isinstance(event, m.IdleMapPublished) or event.router != self.name:
            return
        now = time.time()
        for rid, at in event.last_request.items():
            if rid in self.pool.replicas and rid not in self.idle.last:
                self.idle.last[rid] = min(at.timestamp(), now)
        for rid, at in event.serving_since.items():
            rep = self.pool.replicas.get(rid)
            if rep is not None and rep.in_pool and rid not in self.idle.last:
                rep.pooled_at = min(rep.pooled_at, at.timestamp())
        log.info("router %s: took up its last map (tick %d): %d requests, %d served since", self.name, event.tick,
                 len(event.last_request), len(event.serving_since))

    async def _last_map_before(self) -> tuple[int, bytes] | None:
        """This router's own last idle map as it was before this boot published any (one direct get, kept;
        a failed read is not kept, so the caller's retry reads again)."""
        async with self._before_lock:
            if not self._before_read:
                self._before = await self.bus.last_message(subjects.STREAM_USAGE, subjects.usage_idle(self.name))
                self._before_read = True
            return self._before

    async def stop(self) -> None:
        """Stop serving; a last idle map carries the requests since the last tick."""
        if self.idle_tracking and self.url and not self.bus.closed:
            try:
                event = self._idle_map()
                await self.bus.publish(event, timeout=2.0)
                self._published(event)
                for answered in self.wakes.drain(self.name, self.boot_id):  # the ledger's router part too
                    await self.bus.publish(answered, timeout=2.0)
            except LlmgwError as e:
                log.warning("router %s: last idle map not published: %s", self.name, e)
        self.url = ""
        for held in self.waiting.values():
            for fut in held:
                if not fut.done():
                    fut.set_result("stopping")
        for t in [*self._tasks, *self._wish_tasks]:
            t.cancel()
        for t in list(self._wish_tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        if self._listener is not None:
            self._listener.close()  # no new connections; the runner's cleanup closes the open ones
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.upstream.close()

    async def _retrying(self, what: str, read: Callable[[], Awaitable[None]]) -> None:
        """``read`` until cancelled: after a bus error, again a second later, from where it stopped."""
        while True:
            try:
                await read()
            except LlmgwError as e:
                log.warning("router %s: %s: %s; retrying", self.name, what, e)
                await asyncio.sleep(1.0)

    async def _follow(self) -> None:
        # The pool keeps routing to what it knew meanwhile; the sink resumes where it stopped.
        await self._retrying("control stream", self.sink.run)

    async def _quota_start(self) -> int:
        """Where the quotas' reading of the usage stream starts, having taken up what came before it.

        From the newest fold snapshot: its per-key tokens of today, and every map after it (its
        own earlier ones too: a restart mid-minute or mid-day keeps every window). Without one,
        from this router's own last map (the last tick of its own use, and the others' since).
        """
        from llmgw.fleet import snapshots

        found = await snapshots.newest(self.bus, f"router {self.name}", (subjects.STREAM_USAGE,))
        if found is not None:
            c = found[0]
            today = utc_day(time.time())
            for key, days in c.state.key_usage.items():
                if today in days:
                    self.quotas.used(key, days[today][1], time.time())
            return c.cursor.positions.get(subjects.STREAM_USAGE, 0) + 1
        own = await self._last_map_before()
        return own[0] if own is not None else await self.bus.stream_last_seq(subjects.STREAM_USAGE) + 1

    async def _follow_usage(self) -> None:
        """The routers' maps, as they are published: what each key asked anywhere counts here too."""
        next_seq = 0  # 0: not started (where to start is found first)

        async def read() -> None:
            nonlocal next_seq
            if not next_seq:
                next_seq = await self._quota_start()
            follower = self.bus.follow(subjects.STREAM_USAGE, m.USAGE_DECODER, next_seq, who=f"router {self.name}",
                                       keep=lambda raw: raw.subject.endswith(".idle"))
            async for batch in follower.batches():
                for d in batch:
                    if type(d.event) is m.IdleMapPublished and d.event.boot_id != self.boot_id:
                        self.quotas.other_map(d.event)  # (this boot's own use is counted as it happens)
                next_seq = follower.last_seq + 1

        await self._retrying("usage stream", read)

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await self.publish_idle_map()
            except LlmgwError as e:
                # The next map carries everything this one would have: maps are cumulative.
                log.warning("router %s: idle map not published: %s", self.name, e)

    async def publish_idle_map(self) -> m.IdleMapPublished:
        """Publish this tick's idle map now (and a wish for each model still waiting); return the map."""
        event = self._idle_map()
        await self.bus.publish(event, timeout=max(1.0, self.tick_s))
        self._published(event)
        now = time.monotonic()
        for table in self.prefixes.values():
            table.expire(now)  # prefixes nobody sent for prefixroute.WINDOW_S
        for answered in self.wakes.drain(self.name, self.boot_id):
            await self.bus.publish(answered, timeout=max(1.0, self.tick_s))
        # Again while it is still parked (a lost wish, a scheduler that was away); not while it starts.
        for model in [name for name, held in self.waiting.items() if held and self.pool.model_state(name) == "parked"]:
            self._wish(model)
        return event

    def _idle_map(self) -> m.IdleMapPublished:
        """This tick's map, with the prompt tokens each replica's engine reported since the last one."""
        event = self.idle.idle_map(self.name, self.boot_id, self.pool, m.utcnow(), self._queued(), self.tick_s,
                                   self.sink.applied_seq)
        changes: dict[str, Any] = {}
        if self._cache_use:
            changes["cache_use"] = {rid: m.CacheUse(model, min(p, TOKENS_MAX), min(c, p, TOKENS_MAX))
                                    for rid, (model, p, c) in sorted(self._cache_use.items())}
        if self._key_use:
            changes["callers"] = {key: {model: use.message() for model, use in sorted(per.items())}
                                  for key, per in sorted(self._key_use.items())}
        return msgspec.structs.replace(event, **changes) if changes else event

    def _published(self, event: m.IdleMapPublished) -> None:
        """What a published map carried is taken off; a map not published leaves it for the next."""
        self.idle_maps += 1
        for key, per in event.callers.items():
            for model, sent in per.items():
                counter = self._key_use.get(key, {}).get(model)
                if counter is not None and counter.take(sent):
                    del self._key_use[key][model]
            if not self._key_use.get(key):
                self._key_use.pop(key, None)
        for rid, use in event.cache_use.items():
            left = self._cache_use.get(rid)
            if left is not None:
                left[1] -= use.prompt_tokens
                left[2] -= use.cached_tokens
                if left[1] <= 0 or rid not in self.pool.replicas:
                    del self._cache_use[rid]

    def _key_use_of(self, key: str, model: str) -> KeyUseCounter:
        per_model = self._key_use.setdefault(key, {})
        use = per_model.get(model)
        if use is None:
            use = per_model[model] = KeyUseCounter()
        return use

    def _count_tokens(self, rep: Replica, model: str, usage: Usage, request: web.Request | None = None) -> None:
        """An answer's ``usage``: the metrics, the replica's share and the key's, for the next map."""
        self.metrics.tokens(model, usage)
        if request is not None and (who := request.get("llmgw_key")) is not None:
            self._key_use_of(who.name, model).add_tokens(usage)
            self.quotas.used(who.name, usage.prompt_tokens + usage.completion_tokens, time.time())
        if self.idle_tracking and usage.prompt_tokens:
            use = self._cache_use.setdefault(rep.replica_id, [model, 0, 0])
            use[1] += usage.prompt_tokens
            use[2] += usage.cached_tokens

    # --- waking a model ------------------------------------------------------------

    def _queued(self) -> dict[str, int]:
        return {name: len(held) for name, held in self.waiting.items() if held}

    def _wish(self, model: str) -> None:
        """Publish ``ModelWanted`` for a model, at most once per tick; never awaits."""
        if self._wished_at_tick.get(model) == self.idle.tick:
            return
        self._wished_at_tick[model] = self.idle.tick
        event = m.ModelWanted(at=m.utcnow(), router=self.name, boot_id=self.boot_id, model=model,
                              control_seq=self.sink.applied_seq, waiting=max(len(self.waiting.get(model, ())), 1))
        task = asyncio.create_task(self._publish_wish(event), name=f"router-wish-{model}")
        self._wish_tasks.add(task)
        task.add_done_callback(self._wish_tasks.discard)

    async def _publish_wish(self, event: m.ModelWanted) -> None:
        try:
            await self.bus.publish(event, timeout=max(1.0, self.tick_s))
            self.wishes += 1
            self.metrics.wish(event.model)
        except LlmgwError as e:
            # The next tick publishes again while requests still wait.
            self._wished_at_tick.pop(event.model, None)
            log.warning("router %s: wish for %s not published: %s", self.name, event.model, e)

    def _pool_changed(self) -> None:
        """Release held requests, oldest first, once their model serves or cannot wake."""
        for model, held in list(self.waiting.items()):
            state = self.pool.model_state(model)
            if state in ("parked", "starting"):
                continue
            for fut in held:
                if not fut.done():
                    fut.set_result(state)
            del self.waiting[model]

    async def _wake(self, model: str, key: int | None = None) -> tuple[Replica | None, str]:
        """Hold a request until its model has a healthy replica: (replica, "") or (None, why not)."""
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        held_since = time.time()
        held = self.waiting.setdefault(model, [])
        held.append(fut)
        self._wish(model)
        try:
            async with asyncio.timeout(self.wake_timeout_s):
                state = await fut
        except TimeoutError:
            state = "timeout"
        finally:
            if fut in held:
                held.remove(fut)
            if not held and self.waiting.get(model) is held:
                del self.waiting[model]
        self.metrics.held(model, "served" if state == "serving" else state, time.time() - held_since)
        if state == "serving":
            rep = self.acquire(model, key=key)
            if rep is not None:
                self.wakes.released(model, rep.replica_id, held_since, time.time())
                return rep, ""
            state = self.pool.model_state(model)
        return None, state

    # --- handlers -----------------------------------------------------------------

    def _authorized(self, request: web.Request) -> bool:
        """Whether the request may go on; its key's name, if any, is kept on it (``llmgw_key``)."""
        scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""  # auth schemes are case-insensitive (RFC 9110)
        if token.startswith(m.KEY_PREFIX):
            # One of ours (ctl key): live, unexpired and its digest's, or refused, even where anonymous
            # requests are allowed (a router with no --api-keys and no key declared).
            key = self._declared_key(token)
            if key is None:
                return False
            request["llmgw_key"] = key
            return True
        if self.keys and token:
            digest = hashlib.sha256(token.encode()).hexdigest()
            ok = False
            for static in self.keys:  # every key compared, so timing says nothing about which matched
                ok |= hmac.compare_digest(digest, static)
            if ok:
                return True
        return not self.keys and not self.sink.keys_by_id  # anonymous: only while no key exists anywhere

    def _declared_key(self, token: str) -> m.KeyDeclared | None:
        """The live key ``token`` is the secret of (found by the id in it, checked by its salted digest)."""
        key_id = token[len(m.KEY_PREFIX):len(m.KEY_PREFIX) + 16]
        key = self.sink.keys_by_id.get(key_id)
        # The digest is computed and compared whatever the lookup found, so a wrong id costs what a wrong secret does.
        salt = key.salt if key is not None else _NO_SALT
        expected = key.digest if key is not None else _NO_DIGEST
        got = hashlib.sha256(bytes.fromhex(salt) + token.encode(errors="replace")[:512]).hexdigest()
        if not hmac.compare_digest(got, expected) or key is None:
            return None
        if key.expires_at is not None and key.expires_at <= m.utcnow():
            return None
        return key

    def _handler(self, route: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self.proxy(request, route)

        return handle

    async def proxy(self, request: web.Request, route: str) -> web.StreamResponse:
        """Pass one OpenAI request to a replica and its answer back."""
        t0 = time.perf_counter()
        model, stream, status = "", False, 500
        try:
            if not self._authorized(request):
                status = 401
                self.metrics.error("", "unauthorized")
                return api.unauthorized()
            if request.content_length is not None and request.content_length > self.max_body_bytes:
                # Refuse before reading: the announced size is already too large.
                status = 413
                return self._too_large()
            try:
                # A client that stops halfway through its body (slow-loris) must not hold a
                # connection and a handler forever.
                async with asyncio.timeout(self.body_timeout_s):
                    body = await self._read_body(request)
            except TimeoutError:
                status = 408
                self.metrics.error("", "body_timeout")
                late = api.error(408, f"the request body did not arrive within {self.body_timeout_s:g}s",
                              "invalid_request_error", "request_timeout")
                late.force_close()  # what is left of that body must not be read as a request
                return late
            except web.RequestPayloadError as e:  # not the gzip it claims; framing aiohttp's parser refused
                status = 400
                reason = _reason(e)
                self._refused(request.remote or "?", reason, False)
                # aiohttp would read the rest after the answer and log the same error again, as a traceback.
                request.content.feed_eof()
                bad = api.error(400, f"the request body could not be read: {reason}", "invalid_request_error",
                                "malformed_request")
                bad.force_close()
                return bad
            if body is None:
                status = 413
                return self._too_large()
            try:
                head = _HEAD.decode(body)
            except m.DECODE_ERRORS as e:
                status = 400
                self.metrics.error("", "bad_request")
                return api.error(400, f"request body is not a valid JSON object with a string `model` ({e})",
                              "invalid_request_error", "invalid_json")
            model, stream = head.model, head.stream
            if not model:
                status = 400
                self.metrics.error("", "bad_request")
                return api.error(400, "the request has no `model`; name one of GET /v1/models",
                              "invalid_request_error", "missing_model", "model")
            key: m.KeyDeclared | None = request.get("llmgw_key")
            if key is not None and key.models and model not in key.models:
                status = 403
                self.metrics.error("", "forbidden_model")
                return api.error(403, f"this key may not use the model `{model}` (it may use: {', '.join(key.models)})",
                                 "permission_error", "model_not_allowed", "model")
            if key is not None:
                now = time.time()
                if (over := self.quotas.refusal(key, now)) is not None:
                    status = 429
                    code, why, wait = over
                    self.metrics.error("", "rate_limited" if code == "rate_limit_exceeded" else "quota_exceeded")
                    return api.error(429, why, "requests" if code == "rate_limit_exceeded" else "insufficient_quota",
                                     code, headers={"Retry-After": str(math.ceil(wait))})
                self.quotas.took(key.name, now)
            resp = await self._forward(request, route, model, stream, body, t0,
                                       self.routing_key(model, route, body))
            status = resp.status
            return resp
        except _ClientGone as gone:
            status = CLIENT_CLOSED
            return gone.resp  # aiohttp finishes it quietly: the connection is gone
        except asyncio.CancelledError:
            # handler_cancellation: the client closed its connection while we waited.
            status = CLIENT_CLOSED
            raise
        finally:
            if status == CLIENT_CLOSED:
                self.metrics.error(model if model in self.pool.known_models else "", "client_closed")
            # Only known models become labels: a client must not grow the metrics at will.
            label = model if model in self.pool.known_models else ""
            self.metrics.observe(label, route, status, stream, time.perf_counter() - t0)
            if (who := request.get("llmgw_key")) is not None and label:
                self._key_use_of(who.name, label).add_request(status, time.perf_counter() - t0)

    async def _read_body(self, request: web.Request) -> bytes | None:
        """The body as the engine will get it (decompressed), or None once it passes the limit."""
        parts: list[bytes] = []
        size = 0
        while chunk := await request.content.readany():
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            parts.append(chunk)
        return b"".join(parts)

    def _too_large(self) -> web.Response:
        self.metrics.error("", "too_large")
        big = api.error(413, f"request body is larger than this router's limit of {_size_text(self.max_body_bytes)}; "
                             "send less, or start the router with a larger --max-body (e.g. --max-body 64MiB)",
                        "invalid_request_error", "request_too_large")
        big.force_close()  # what is left of that body must not be read as a request
        return big

    def _refused(self, remote: str, reason: str, quiet: bool) -> None:
        """A request the router could not read: counted, and one line in the log."""
        self.metrics.error("", "bad_request")
        (log.debug if quiet else log.warning)("router %s: unreadable request from %s: %s", self.name, remote, reason)

    async def _forward(self, request: web.Request, route: str, model: str, stream: bool,
                       body: bytes, t0: float, key: int | None = None) -> web.StreamResponse:
        who: m.KeyDeclared | None = request.get("llmgw_key")
        if (refused := await self._admit(model, who.priority if who is not None else "normal")):
            self.metrics.error(model, "shed")
            return api.error(429 if refused == "shed" else 503,
                             f"model {model!r} is at capacity and {'this priority is shed first' if refused == 'shed' else 'no slot freed in time'}; "
                             f"retry after {RETRY_AFTER_S}s", "server_error", "model_at_capacity", "model",
                             headers={"Retry-After": str(RETRY_AFTER_S)})
        rep = self.acquire(model, key=key)
        woken = False
        if rep is None:
            # Only a declared model wakes: one placed by a control plane we do not follow
            # (or whose declaration was removed) answers at once, as before.
            state = self.pool.model_state(model) if model in self.pool.declared else ""
            if state == "unplaceable":
                self._wish(model)  # the demand is recorded; the scheduler retries as cards free up
            if state not in ("parked", "starting"):
                return self._unavailable(model, state)
            rep, state = await self._wake(model, key)
            if rep is None:
                return self._unavailable(model, state)
            woken = True
        retried = False
        while True:
            try:
                up = await self.upstream.post(rep.endpoint, route, body, _JSON)
            except CONNECT_ERRORS as e:
                self.release(rep)
                self.metrics.error(model, "upstream_connect")
                # Another replica if there is one; else the same once more, since a kept-alive
                # connection the engine had just closed fails the same way as a dead engine.
                other = None if retried else (self.acquire(model, exclude=rep, key=key) or self.acquire(model))
                if other is None:
                    return api.error(502, f"replica {rep.replica_id} of {model} could not be reached ({type(e).__name__}) "
                                       "and no other replica could take the request; retry shortly",
                                  "server_error", "upstream_unreachable")
                self.metrics.retry()
                retried, rep = True, other
                continue
            except TimeoutError:
                self.release(rep)
                self.metrics.error(model, "upstream_timeout")
                return api.error(504, f"replica {rep.replica_id} of {model} did not answer within "
                                   f"{self.upstream.timeouts.read_s:g}s", "server_error", "upstream_timeout")
            except BaseException:
                self.release(rep)
                raise
            if woken:  # the first byte of a held request's answer: the wake's last phase
                self.wakes.answered(model, time.time())
                woken = False
            try:
                if stream and up.status == 200:
                    return await self._pipe(request, up, rep, model, t0)
                try:
                    data = await up.read()
                except READ_ERRORS as e:
                    up.close()
                    self.metrics.error(model, "upstream_broken")
                    return api.error(502, f"replica {rep.replica_id} of {model} broke off its answer ({type(e).__name__})",
                                  "server_error", "upstream_broken")
                if up.status == 200 and (usage := usage_of(data)) is not None:
                    self._count_tokens(rep, model, usage, request)
                if up.status == 413 and not up.headers.get("Content-Type", "").startswith("application/json"):
                    # An engine whose own limit is below the router's (aiohttp's 1 MiB, a proxy's)
                    # answers in plain text; the client still gets an error it can read.
                    self.metrics.error(model, "too_large")
                    return api.error(413, f"replica {rep.replica_id} of {model} refused a body of "
                                          f"{_size_text(len(body))}: its engine takes less than this router's limit "
                                          f"of {_size_text(self.max_body_bytes)}; send less, or set the router's "
                                          "--max-body to the engine's limit so that the router refuses such bodies",
                                     "invalid_request_error", "request_too_large")
                return web.Response(status=up.status, body=data, headers={
                    "Content-Type": up.headers.get("Content-Type", "application/json"),
                    "x-llmgw-replica": rep.replica_id,
                })
            except BaseException:
                up.close()  # a client gone or a write failed: never reuse a half-read connection
                raise
            finally:
                up.release()
                self.release(rep)

    async def _pipe(self, request: web.Request, up: aiohttp.ClientResponse, rep: Replica,
                    model: str, t0: float) -> web.StreamResponse:
        """Write the engine's stream on as it arrives; a break becomes an error event, not a hang.

        The first chunk's arrival is the time to first token; the stream's last chunks are kept
        (bounded) for the ``usage`` an engine sends before ``[DONE]`` (``stream_options.include_usage``).
        """
        resp = web.StreamResponse(status=up.status, headers={
            "Content-Type": up.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache",
            "x-llmgw-replica": rep.replica_id,
        })
        read = up.content.readany
        tail: deque[bytes] = deque()
        kept = 0
        first = True
        try:
            await resp.prepare(request)
            while True:
                # The engine's side and the client's are told apart: a client that went away
                # is not a broken replica, and a broken replica is not the client's doing.
                try:
                    chunk = await read()
                except READ_ERRORS as e:
                    await self._broken(resp, up, rep, model, e)
                    return resp
                if not chunk:
                    await resp.write_eof()
                    if (usage := usage_of_stream(b"".join(tail))) is not None:
                        self._count_tokens(rep, model, usage, request)
                    return resp
                if first:
                    first = False
                    self.metrics.first_token(model, time.perf_counter() - t0)
                    if (who := request.get("llmgw_key")) is not None:
                        self._key_use_of(who.name, model).ttft_s += time.perf_counter() - t0
                tail.append(chunk)
                kept += len(chunk)
                while kept - len(tail[0]) >= USAGE_TAIL_BYTES:
                    kept -= len(tail.popleft())
                await resp.write(chunk)
        except ConnectionResetError as e:  # aiohttp's "Cannot write to closing transport" is one
            raise _ClientGone(resp) from e

    async def _broken(self, resp: web.StreamResponse, up: aiohttp.ClientResponse, rep: Replica,
                      model: str, e: BaseException) -> None:
        """End a stream the engine broke off with an error event the client's SDK raises."""
        up.close()
        self.metrics.error(model, "upstream_broken")
        with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionError):
            await resp.write(b"\n\ndata: " + api.error_body(
                f"replica {rep.replica_id} of {model} broke off the stream ({type(e).__name__}); "
                "the reply is incomplete", "server_error", "upstream_broken") + b"\n\n")
            await resp.write_eof()

    def _unavailable(self, model: str, state: str = "") -> web.Response:
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        if state == "timeout":
            self.metrics.error(model, "wake_timeout")
            return api.error(503, f"model {model!r} is starting (woken by a request) and had no healthy replica within "
                               f"{self.wake_timeout_s:g}s; retry after {RETRY_AFTER_S}s",
                          "server_error", "model_starting", "model", headers=retry)
        if state == "unplaceable":
            self.metrics.error(model, "unplaceable")
            d = self.pool.declared.get(model)
            why = d.unplaceable if d is not None and d.unplaceable else "the scheduler found no room"
            return api.error(503, f"model {model!r} cannot be placed: {why}", "server_error", "model_unplaceable", "model")
        if state == "stopped":
            self.metrics.error(model, "stopped")
            return api.error(503, f"model {model!r} is scaled to 0 replicas by its operator; "
                               f"`llmgw ctl model scale {model} --replicas 1` brings it back",
                          "server_error", "model_stopped", "model")
        if model in self.pool.known_models:
            self.metrics.error(model, "no_replica")
            return api.error(503, f"model {model!r} has no healthy replica right now; retry after {RETRY_AFTER_S}s",
                          "server_error", "no_healthy_replica", "model", headers=retry)
        self.metrics.error("", "unknown_model")
        return api.error(404, f"the model `{model}` does not exist; GET /v1/models lists the models served",
                      "invalid_request_error", "model_not_found", "model")

    async def models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            self.metrics.error("", "unauthorized")
            return api.unauthorized()
        data = [api.model_object(name, state, self.pool.created(name)) for name, state in self.pool.listed().items()]
        return web.Response(body=_ENC.encode({"object": "list", "data": data}), content_type="application/json")

    async def model(self, request: web.Request) -> web.Response:
        """One model of GET /v1/models (the OpenAI client's ``models.retrieve``), or a 404."""
        if not self._authorized(request):
            self.metrics.error("", "unauthorized")
            return api.unauthorized()
        name = request.match_info["model"]
        state = self.pool.listed().get(name)
        if state is None:
            return api.error(404, f"the model `{name}` does not exist; GET /v1/models lists the models served",
                          "invalid_request_error", "model_not_found", "model")
        return web.Response(body=_ENC.encode(api.model_object(name, state, self.pool.created(name))),
                            content_type="application/json")

    async def no_route(self, request: web.Request) -> web.Response:
        """Any path or method the router does not serve: an OpenAI-style 404 or 405, so clients show why."""
        path = request.path
        allowed = METHODS.get(path) or ("GET" if path.startswith("/v1/models/") else None)
        if allowed is None:
            return api.error(404, f"{request.method} {path} is not a route of this router; it serves "
                               f"{', '.join(ROUTES)} (POST) and /v1/models (GET)",
                          "invalid_request_error", "unknown_url")
        allow = f"{allowed}, HEAD" if allowed == "GET" else allowed
        return api.error(405, f"{request.method} is not allowed on {path}; use {allowed}",
                      "invalid_request_error", "method_not_allowed", headers={"Allow": allow})

    async def health(self, request: web.Request) -> web.Response:
        """Readiness: 503 until caught up. Without NATS it still serves what it knew (200), but
        says ``degraded``: it can neither see replicas come and go nor publish idle maps."""
        ready = self.sink.caught_up.is_set()
        bus_up = self.bus.connected
        body = {"status": ("ok" if bus_up else "degraded") if ready else "starting", "router": self.name,
                "boot_id": self.boot_id, "bus": "up" if bus_up else "down",
                "healthy_replicas": sum(len(r) for r in self.pool.healthy.values()),
                "control_seq": self.sink.applied_seq}
        return web.Response(status=200 if ready else 503, body=_ENC.encode(body), content_type="application/json")

    async def render_metrics(self, request: web.Request) -> web.Response:
        """Prometheus text, or OpenMetrics when the scraper's Accept header asks for it."""
        body, content_type = self.metrics.render(request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type, "X-Content-Type-Options": "nosniff"})


async def serve_router(bus: Bus, name: str, host: str, port: int, **kwargs: object) -> None:
    """Run a router until cancelled (the CLI's and ``llmgw up``'s entry point)."""
    router = Router(bus, name, **kwargs)  # type: ignore[arg-type]
    url = await router.start(host, port)
    print(url, flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    # SIGTERM (a supervisor stopping us) ends as cleanly as Ctrl-C: the last map is published.
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    try:
        await stopping.wait()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        await router.stop()
