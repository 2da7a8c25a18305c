"""Once per request: its key, its quota, its slot, its replica, the engine's answer, its count.

* ``acquire`` picks the replica with the fewest outstanding requests, rotating the
  start so ties spread the load (for a model routed by prefix, where its prompt's
  prefix is homed: ``prefix``), and writes the request time for idle tracking. It
  never awaits: on the event loop that makes it the critical section the seed's
  lock was, at no cost. At a model's declared capacity a request first waits for a
  slot by its key's priority (``_admit``); one for a parked model is held by
  ``wake.Wake``, then goes on here like any other. What it used is added up for
  the next idle map (``ticks``): no I/O, no lock.
* A body is read once (``openai_api.Head``: model, limits, the prompt as raw slices) and
  passes through untouched, but that a stream is asked for its usage
  (``openai_api.usage_asked``); streams are written on chunk by chunk.
* A keyed request holds the tokens it may use from being taken to its end (``Call.hold``,
  ``quotas.reserve``, ``_settle``), so parallel requests cannot overspend a day.
* The body limit (``--max-body``) is the router's own, checked before anything is
  forwarded: against Content-Length when there is one, and while reading otherwise
  (chunked, or decompressed from gzip). A body the router cannot read (not the
  gzip it claims, broken chunked framing) is a 400 and one log line, never a
  traceback a client could repeat at will.
* A client that leaves before its answer is written is ``client_closed``
  (status 499, as nginx logs it): its doing, not the router's, and no traceback.

Over 600 lines: one request's path, from its key to its count, reads top to bottom here;
split in two, each half would take the other's state (slot, replica, stream tail) as arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.clientsockets import unreadable
from llmgw.engine.upstream import CONNECT_ERRORS, READ_ERRORS, Answer, Upstream
from llmgw.fleet.pool import Adapter
from llmgw.messages.usage import ANONYMOUS_CALLER
from llmgw.router import openai_api as api
from llmgw.router import prefix as prefixroute
from llmgw.router.access import HEADER, Call
from llmgw.router.adapters import AdapterError, Adapters, lora_body
from llmgw.router.endpoints import EndpointSink, Pool, Replica
from llmgw.router.idle import IdleTracker
from llmgw.router.metrics import Metrics, Usage, usage_of, usage_of_stream
from llmgw.router.quotas import KeyUseCounter, Quotas, Reservation, estimate, key_use_of
from llmgw.router.wake import Wake

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# Every path the router answers and its methods: anything else gets an OpenAI-style 404 or 405.
METHODS = {**dict.fromkeys(ROUTES, "POST"), "/v1/models": "GET", "/health": "GET", "/metrics": "GET"}
RETRY_AFTER_S = 5
USAGE_TAIL_BYTES = 64 * 1024  # how much of a stream's end is kept to find the engine's `usage` in
PRIORITIES = ("high", "normal", "low")  # the order a freed slot goes in (ctl key --priority)
QUEUE_PER_SLOT = 2  # requests queued per slot of a model's replicas before low ones are shed
QUEUE_MAX_PER_SLOT = 32  # … and before a normal or high one hears the queue is full
_NO_SALT = "00" * 16  # for a key id nobody has: the digest is still computed (same cost)
_NO_DIGEST = "0" * 64


class _ClientGone(Exception):  # noqa: N818 - a control-flow signal inside the router, never raised out of it
    """The client went away while its answer was being written; ``resp`` is what was begun."""

    def __init__(self, resp: web.StreamResponse) -> None:
        super().__init__("client closed the connection")
        self.resp = resp


CLIENT_CLOSED = 499  # nginx's status for a request whose client left before the answer
_ENC = msgspec.json.Encoder()
_NO_LOAD: dict[str, str] = {}


def _size_text(n: int) -> str:
    """``33554432 bytes (32 MiB)``: the exact number, and one a person reads."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n} bytes ({n / scale:g} {unit})"
    return f"{n} bytes"


class Gateway:
    """A request's whole path, and the answers that need no replica (/v1/models, /health, /metrics)."""

    def __init__(self, *, bus: Bus, name: str, boot_id: str, pool: Pool, sink: EndpointSink, metrics: Metrics,
                 upstream: Upstream, quotas: Quotas, wake: Wake, idle: IdleTracker,
                 prefixes: dict[str, prefixroute.PrefixTable], key_use: dict[str, dict[str, KeyUseCounter]],
                 cache_use: dict[str, list[Any]], refused: Callable[[str, str, bool], None], keys: tuple[str, ...],
                 max_body_bytes: int, body_timeout_s: float, idle_tracking: bool) -> None:
        self.bus = bus
        self.name = name
        self.boot_id = boot_id
        self.pool = pool
        self.sink = sink
        self.metrics = metrics
        self.upstream = upstream
        self.quotas = quotas  # per key: requests a minute, tokens a day, this router's and the others'
        self.wake = wake
        self.keys = keys
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.idle_tracking = idle_tracking
        # Written here, collected by the ticks: last requests, prefix homes, each key's and replica's use.
        self.idle = idle
        self.prefixes = prefixes
        self._key_use = key_use
        self._cache_use = cache_use
        self._refused = refused  # an unreadable body: counted and logged with the parser's refusals
        self._rr = 0
        # Per model at capacity, the requests waiting for a slot, by priority (the keys').
        self._queues: dict[str, dict[str, deque[asyncio.Future[str]]]] = {}
        self.adapters = Adapters(bus=bus, name=name, pool=pool, upstream=upstream, take=self._take)

    # --- choosing and admitting ---------------------------------------------------

    def acquire(self, model: str, exclude: Replica | None = None, key: int | None = None,
                caller: str = ANONYMOUS_CALLER) -> Replica | None:
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
            chosen = prefixroute.pick(table, key, reps, exclude, caller=caller)
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

    async def _pick(self, model: str, lora: Adapter | None, body: bytes, key: int | None,
                    exclude: Replica | None = None, picked: list[str] | None = None,
                    call: Call | None = None) -> tuple[Replica | None, bytes]:
        """The replica for a request and the body to send it: an adapter's holder (``adapters``), or a
        replica of the model; a llama.cpp replica with adapters attached gets every one at scale 0."""
        sent = call.lora_in if call is not None else True  # may the body hold a `lora`?
        if lora is not None:
            chosen = await self.adapters.choose(model, lora, body, exclude, sent)
            if chosen is None:
                return None, body
            if call is not None:
                call.lora_in = True  # what is sent from here on holds one
            if picked is not None:
                picked.append(chosen.replica.replica_id)
            if chosen.loaded_s and call is not None:  # the adapter's load it waited for, in its answer
                call.lora_load = {"x-llmgw-adapter-load-ms": f"{chosen.loaded_s * 1000:.1f}"}
            return chosen.replica, chosen.body
        who = call.key if call is not None else None  # whose prefixes these are (prefix.Callers)
        rep = self.acquire(model, exclude, key, who.name if who is not None else ANONYMOUS_CALLER)
        if rep is not None and rep.adapters:
            body = lora_body(body, rep.adapters, "", 0.0, sent)
            if call is not None:
                call.lora_in = True
        return rep, body

    async def _other(self, model: str, lora: Adapter | None, body: bytes, rep: Replica,
                     key: int | None, picked: list[str], call: Call) -> tuple[Replica | None, bytes]:
        """Another replica after ``rep`` could not be reached (the same once more when there is none), and the
        body to send it (a llama.cpp replica's ``lora`` list is its own)."""
        try:
            other, sent = await self._pick(model, lora, body, key, exclude=rep, picked=picked, call=call)
            if other is None:
                other, sent = await self._pick(model, lora, body, key, picked=picked, call=call)
        except AdapterError:
            return None, body
        return other, sent

    def _take(self, rep: Replica) -> Replica:
        rep.outstanding += 1
        if self.idle_tracking:
            self.idle.last[rep.replica_id] = time.time()
        return rep

    def routing_key(self, model: str, route: str, body: bytes | api.Head) -> int | None:
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
        once ("shed"), and a higher one takes the place of the newest lower one queued (which is
        refused), or, with none lower, waits too: normal and high ones are refused ("full") only
        past QUEUE_MAX_PER_SLOT x slots. Shedding is for the lower priorities, not for a queue of
        normal requests.
        """
        cap = self._saturated(model)
        if not cap:
            return ""
        queues = self._queues.setdefault(model, {p: deque() for p in PRIORITIES})
        slots = cap * len(self.pool.healthy.get(model, ()))
        waiting = sum(len(q) for q in queues.values())
        if waiting >= QUEUE_PER_SLOT * slots:
            lower = PRIORITIES[PRIORITIES.index(priority) + 1:]
            victim = next((queues[p] for p in reversed(lower) if queues[p]), None)
            if victim is not None:
                victim.pop().set_result("displaced")
            elif priority == PRIORITIES[-1]:
                return "shed"
            elif waiting >= QUEUE_MAX_PER_SLOT * slots:
                return "full"
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

    def _count_tokens(self, rep: Replica, model: str, usage: Usage, call: Call) -> None:
        """An answer's ``usage``: the metrics, the replica's share and the key's, for the next map."""
        self.metrics.tokens(model, usage)
        call.trace.counted(usage)
        if (hold := call.hold) is not None:
            hold.counted = True
        if (who := call.key) is not None:
            key_use_of(self._key_use, who.name, model).add_tokens(usage)
            self.quotas.used(who.name, usage.prompt_tokens + usage.completion_tokens, time.time())
        else:  # no key: the anonymous caller's, so that usage and chargeback add up
            key_use_of(self._key_use, ANONYMOUS_CALLER, model).add_tokens(usage)
        if self.idle_tracking and usage.prompt_tokens:
            use = self._cache_use.setdefault(rep.replica_id, [model, 0, 0])
            use[1] += usage.prompt_tokens
            use[2] += usage.cached_tokens

    # --- handlers -----------------------------------------------------------------

    def _authorized(self, request: web.BaseRequest, call: Call | None = None) -> bool:
        """Whether the request may go on; its declared key, if any, is kept on its ``call``."""
        scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""  # auth schemes are case-insensitive (RFC 9110)
        if token.startswith(m.KEY_PREFIX):
            # One of ours (ctl key): live, unexpired and its digest's, or refused, even where anonymous
            # requests are allowed (a router with no --api-keys and no key declared).
            key = self._declared_key(token)
            if key is None:
                return False
            if call is not None:
                call.key = key
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

    async def proxy(self, request: web.BaseRequest, call: Call, route: str) -> web.StreamResponse:
        """Pass one OpenAI request to a replica and its answer back."""
        t0 = time.perf_counter()
        model, stream, status = "", False, 500
        picked: list[str] = []  # replicas an adapter's request was given, each one ``finished`` at the end
        try:
            if not self._authorized(request, call):
                status = 401
                self.metrics.error("", "unauthorized")
                return api.unauthorized()
            if request.content_length is not None and request.content_length > self.max_body_bytes:
                # Refuse before reading: the announced size is already too large.
                status = 413
                return self._too_large()
            try:
                if request.content.is_eof():  # all of it came with the head (most bodies): nothing to wait for
                    body = await self._read_body(request)
                else:
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
                reason = unreadable(e)
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
                head = api.HEAD.decode(body)
            except m.DECODE_ERRORS as e:
                status = 400
                self.metrics.error("", "bad_request")
                return api.error(400, f"request body is not a valid JSON object with a string `model` ({e})",
                              "invalid_request_error", "invalid_json")
            model, stream = head.model, head.stream
            call.lora_in = head.sent_lora()
            if not model:
                status = 400
                self.metrics.error("", "bad_request")
                return api.error(400, "the request has no `model`; name one of GET /v1/models",
                              "invalid_request_error", "missing_model", "model")
            key = call.key
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
                call.hold = self.quotas.reserve(key.name, model, *estimate(len(body), head.completion_cap(),
                                                                               route == "/v1/embeddings"))
            strip_usage = stream and not head.wants_usage()
            if strip_usage:  # every stream's tokens are counted: the engine is asked, the client never sees it
                body = api.usage_asked(body, head)
            resp = await self._send(request, call, route, model, stream, body, t0,
                                    self.routing_key(model, route, head), strip_usage, picked)
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
            for rid in picked:
                self.adapters.finished(rid, model)
            call.trace.ended(model, stream, status)
            if (hold := call.hold) is not None:
                self._settle(hold)
            # Only known models become labels: a client must not grow the metrics at will.
            label = model if model in self.pool.known_models or model in self.pool.adapters else ""
            if status == CLIENT_CLOSED:
                self.metrics.error(label, "client_closed")
            took = time.perf_counter() - t0
            self.metrics.observe(label, route, status, stream, took)
            if label:
                who = call.key
                key_use_of(self._key_use, who.name if who is not None else ANONYMOUS_CALLER,
                           label).add_request(status, took)

    def _settle(self, hold: Reservation) -> None:
        """A keyed request ended: its tokens held are given back; served with no count from its engine
        (a stream cut short before its usage), it is charged what it held, here and in the next map."""
        self.quotas.settle(hold)
        if hold.served and not hold.counted:
            key_use_of(self._key_use, hold.key, hold.model).add_tokens(
                Usage(prompt_tokens=hold.prompt, completion_tokens=hold.completion))
            self.quotas.used(hold.key, hold.tokens, time.time())

    async def _read_body(self, request: web.BaseRequest) -> bytes | None:
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

    async def _send(self, request: web.BaseRequest, call: Call, route: str, model: str, stream: bool, body: bytes,
                    t0: float, key: int | None, strip_usage: bool, picked: list[str]) -> web.StreamResponse:
        who = call.key
        lora = self.pool.adapters.get(model)  # a LoRA adapter: served by its base's replicas that hold it
        target = lora.base if lora is not None else model
        tr, queued = call.trace, time.perf_counter()
        refused = await self._admit(target, who.priority if who is not None else "normal")
        tr.queue_s = time.perf_counter() - queued
        if refused:
            self.metrics.error(model, "shed")
            why = {"shed": "low-priority requests are shed first", "full": "its queue is full",
                   "displaced": "a higher-priority request took this one's place in its queue",
                   }.get(refused, "no slot freed in time")
            return api.error(503 if refused == "timeout" else 429,
                             f"model {model!r} is at capacity and {why}; retry after {RETRY_AFTER_S}s",
                             "server_error", "model_at_capacity", "model", headers={"Retry-After": str(RETRY_AFTER_S)})
        try:
            rep, body = await self._pick(model, lora, body, key, picked=picked, call=call)
        except AdapterError as e:
            self.metrics.error(model, e.code)
            return api.error(e.status, str(e), "server_error", e.code, "model",
                             headers={"Retry-After": str(RETRY_AFTER_S)})
        woken = False
        if rep is None:
            # Only a declared model wakes: one placed by a control plane we do not follow
            # (or whose declaration was removed) answers at once, as before. An adapter wakes its base.
            state = self.pool.model_state(target) if target in self.pool.declared else ""
            if state == "unplaceable":
                self.wake.wish(target)  # the demand is recorded; the scheduler retries as cards free up
            if state not in ("parked", "starting"):
                return self._unavailable(target, state)
            held = time.perf_counter()
            state, held_since = await self.wake.hold(target)
            tr.wake_s = time.perf_counter() - held
            try:
                rep, body = (await self._pick(model, lora, body, key, picked=picked, call=call)
                             if state == "serving"
                             else (None, body))
            except AdapterError as e:
                self.metrics.error(model, e.code)
                return api.error(e.status, str(e), "server_error", e.code, "model")
            if rep is None:  # it cannot wake, or lost its replica again before this request took one
                return self._unavailable(target, self.pool.model_state(target) if state == "serving" else state)
            self.wake.ledger.released(target, rep.replica_id, held_since, time.time())
            woken = True
        retried = False
        # The engine's headers, built once: one dict, completed with the engine's key by ``upstream.proxy``.
        headers = {"Content-Type": "application/json", "X-Request-Id": tr.id}
        if tr.spans is not None:
            headers.update(tr.spans.engine(tr, request.path))
        while True:
            try:
                tr.replica = rep.replica_id
                up = await self.upstream.proxy(rep.endpoint, route, body, headers)
            except CONNECT_ERRORS as e:
                self.release(rep)
                self.metrics.error(model, "upstream_connect")
                # Another replica if there is one; else the same once more, since a kept-alive
                # connection the engine had just closed fails the same way as a dead engine.
                other, body = (None, body) if retried else await self._other(model, lora, body, rep, key, picked, call)
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
            tr.first_byte()
            if woken:  # the first byte of a held request's answer: the wake's last phase
                self.wake.ledger.answered(target, time.time())
                woken = False
            if lora is not None and up.status == 404 and not rep.adapters and not retried:
                # The engine no longer holds it (another router unloaded it): load it again, once.
                up.release()
                self.release(rep)
                self.adapters.forget(rep, model)
                retried = True
                try:
                    rep, body = await self._pick(model, lora, body, key, picked=picked, call=call)
                except AdapterError as e:
                    return api.error(e.status, str(e), "server_error", e.code, "model")
                if rep is None:
                    return self._unavailable(target, self.pool.model_state(target))
                continue
            try:
                if stream and up.status == 200:
                    return await self._pipe(request, call, up, rep, model, t0, strip_usage)
                try:
                    data = await up.read()
                except READ_ERRORS as e:
                    up.close()
                    self.metrics.error(model, "upstream_broken")
                    return api.error(502, f"replica {rep.replica_id} of {model} broke off its answer ({type(e).__name__})",
                                  "server_error", "upstream_broken")
                if up.status == 200 and (hold := call.hold) is not None:
                    hold.served = True
                if up.status == 200 and (usage := usage_of(data)) is not None:
                    self._count_tokens(rep, model, usage, call)
                if up.status == 413 and not up.content_type.startswith("application/json"):
                    # An engine whose own limit is below the router's (aiohttp's 1 MiB, a proxy's)
                    # answers in plain text; the client still gets an error it can read.
                    self.metrics.error(model, "too_large")
                    return api.error(413, f"replica {rep.replica_id} of {model} refused a body of "
                                          f"{_size_text(len(body))}: its engine takes less than this router's limit "
                                          f"of {_size_text(self.max_body_bytes)}; send less, or set the router's "
                                          "--max-body to the engine's limit so that the router refuses such bodies",
                                     "invalid_request_error", "request_too_large")
                if up.status == 401:
                    # The client's key was the router's to check; an engine refuses only the router's own
                    # (its agent's key for this start not read yet, or something else on that port).
                    self.metrics.error(model, "upstream_refused")
                    return api.error(502, f"replica {rep.replica_id} of {model} refused this router's engine key "
                                          f"(its agent's key for this start is not the one the router holds); "
                                          "retry shortly", "server_error", "upstream_refused")
                return web.Response(status=up.status, body=data, headers={
                    "Content-Type": up.content_type or "application/json",
                    "x-llmgw-replica": rep.replica_id, **(call.lora_load or _NO_LOAD),
                })
            except BaseException:
                up.close()  # a client gone or a write failed: never reuse a half-read connection
                raise
            finally:
                up.release()
                self.release(rep)

    async def _pipe(self, request: web.BaseRequest, call: Call, up: Answer, rep: Replica,
                    model: str, t0: float, strip_usage: bool = False) -> web.StreamResponse:
        """Write the engine's stream on as it arrives; a break becomes an error event, not a hang.

        The first chunk's arrival is the time to first token; the stream's last chunks are kept
        (bounded) for the ``usage`` an engine sends before ``[DONE]`` (``stream_options.include_usage``,
        which the router sets on every stream, or vLLM's forced usage: counted, then taken out of a
        stream whose client did not ask for it).
        The usage is counted before ``[DONE]`` is passed on, and counted however the stream ends
        otherwise: a client (openai's) closes as soon as it reads ``[DONE]``, before the body's end.
        """
        resp = web.StreamResponse(status=up.status, headers={
            "Content-Type": up.content_type or "text/event-stream",
            "Cache-Control": "no-cache",
            "x-llmgw-replica": rep.replica_id, HEADER: call.trace.id, **(call.lora_load or _NO_LOAD),
        })
        read = up.readany
        tail: deque[bytes] = deque()
        kept = 0
        held = b""  # an unfinished event, while usage-only events are taken out
        first = True
        counted = False

        def count() -> None:
            nonlocal counted
            counted = True
            if (usage := usage_of_stream(b"".join(tail))) is not None:
                self._count_tokens(rep, model, usage, call)

        try:
            await resp.prepare(request)
            while True:
                # The engine's side and the client's are told apart: a client that went away
                # is not a broken replica, and a broken replica is not the client's doing.
                try:
                    chunk = await read()
                except READ_ERRORS as e:
                    call.trace.error = "upstream_broken"
                    await self._broken(resp, up, rep, model, e)
                    return resp
                if not chunk:
                    if not counted:
                        count()
                    if held:
                        await resp.write(held)
                    await resp.write_eof()
                    return resp
                if first:
                    first = False
                    call.trace.first_byte()
                    self.metrics.first_token(model, time.perf_counter() - t0)
                    if (who := call.key) is not None:
                        key_use_of(self._key_use, who.name, model).add_ttft(time.perf_counter() - t0)
                    if (hold := call.hold) is not None:
                        hold.served = True
                edge = tail[-1][-8:] if tail else b""  # "[DONE]" cut in two by the network
                tail.append(chunk)
                kept += len(chunk)
                while kept - len(tail[0]) >= USAGE_TAIL_BYTES:
                    kept -= len(tail.popleft())
                if not counted and b"[DONE]" in edge + chunk:
                    count()
                if strip_usage:
                    chunk, held = api.without_usage_chunks(held + chunk)
                    if not chunk:
                        continue
                await resp.write(chunk)
        except ConnectionResetError as e:  # aiohttp's "Cannot write to closing transport" is one
            raise _ClientGone(resp) from e
        finally:
            if not counted:  # the client left (or the handler was cancelled): what was served still counts
                count()

    async def _broken(self, resp: web.StreamResponse, up: Answer, rep: Replica,
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
                               f"{self.wake.timeout_s:g}s; retry after {RETRY_AFTER_S}s",
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

    async def models(self, request: web.BaseRequest) -> web.Response:
        if not self._authorized(request):
            self.metrics.error("", "unauthorized")
            return api.unauthorized()
        listed = self.pool.listed()
        data = [api.model_object(name, state, self.pool.created(name)) for name, state in listed.items()]
        data += [api.model_object(name, listed[a.base], self.pool.created(a.base), parent=a.base)
                 for name, a in sorted(self.pool.adapters.items()) if a.base in listed]
        return web.Response(body=_ENC.encode({"object": "list", "data": data}), content_type="application/json")

    async def model(self, request: web.BaseRequest, name: str) -> web.Response:
        """One model of GET /v1/models (the OpenAI client's ``models.retrieve``), or a 404."""
        if not self._authorized(request):
            self.metrics.error("", "unauthorized")
            return api.unauthorized()
        listed = self.pool.listed()
        if (a := self.pool.adapters.get(name)) is not None and a.base in listed:
            return web.Response(body=_ENC.encode(api.model_object(name, listed[a.base], self.pool.created(a.base),
                                                                  parent=a.base)), content_type="application/json")
        state = listed.get(name)
        if state is None:
            return api.error(404, f"the model `{name}` does not exist; GET /v1/models lists the models served",
                          "invalid_request_error", "model_not_found", "model")
        return web.Response(body=_ENC.encode(api.model_object(name, state, self.pool.created(name))),
                            content_type="application/json")

    async def no_route(self, request: web.BaseRequest) -> web.Response:
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

    async def health(self, request: web.BaseRequest) -> web.Response:
        """Readiness: 503 until caught up. Without NATS it still serves what it knew (200), but
        says ``degraded``: it can neither see replicas come and go nor publish idle maps."""
        ready = self.sink.caught_up.is_set()
        bus_up = self.bus.connected
        body = {"status": ("ok" if bus_up else "degraded") if ready else "starting", "router": self.name,
                "boot_id": self.boot_id, "bus": "up" if bus_up else "down",
                "healthy_replicas": sum(len(r) for r in self.pool.healthy.values()),
                "control_seq": self.sink.applied_seq}
        return web.Response(status=200 if ready else 503, body=_ENC.encode(body), content_type="application/json")

    async def render_metrics(self, request: web.BaseRequest) -> web.Response:
        """Prometheus text, or OpenMetrics when the scraper's Accept header asks for it."""
        body, content_type = self.metrics.render(request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type, "X-Content-Type-Options": "nosniff"})
