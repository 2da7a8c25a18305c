"""The web dashboard: one read-only page of the fleet, kept live with Server-Sent Events.

One process serves any number of pages from one view of the fleet: it follows
the tail of the fleet and control streams for the timeline, and asks the
projector's status service only while a page is open: at once when one of
those events arrives (at most every ``MIN_GAP_S``), else once an interval for
GPU use and idle times. So twenty open pages cost the projector what one does. Every section is rendered
here, with every value escaped; the page's script only swaps in the sections
that changed. When the projector does not answer, the page says
"reconnecting" and shows what it said last, until it answers again.

No client can hold it for the others (``Limits``): only live event streams
count as pages, one address may hold only its share of them, and a socket
that sends nothing, sends a request too slowly or reads nothing is closed
after a bound. The login cookie holds a random session id, never the key.

Who may open it: a key of the ``--api-keys`` file (the router's), or a live ``ctl key`` with
scope ``viewer`` or ``admin`` (read from the whole control stream). While neither exists the
page is open to whoever reaches it. Tenants' names and usage, and where engines listen, are shown
to an admin alone (a file key counts as one): a viewer, or anyone on an open page, sees the fleet
and how many keys are near their limits, not whose.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from importlib import resources
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.clientsockets import ClientSockets, CountedConnection, client_of, unreadable
from llmgw.dashboard.page import login_page, page, render
from llmgw.errors import BusError, ConfigError, LlmgwError, NoServiceError

log = logging.getLogger(__name__)

COOKIE = "llmgw_session"
OLD_COOKIE = "llmgw_key"  # held the key itself before sessions; cleared wherever it still is
MIN_GAP_S = 0.5  # between two status requests, however many events arrive
FIRST_EVENTS_WAIT_S = 2.0  # the first page waits at most this long for the latest events to be read
SECTIONS = ("conn", "summary", "attention", "capacity", "fabrics", "tenants", "models", "gpus", "events")
STATIC = {"dashboard.css": "text/css", "dashboard.js": "text/javascript"}
SECURITY_HEADERS = {
    # No inline script or style anywhere: even a value that escaped escaping could not run.
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}

# What a key's record holds that only the routers need (they read it from the control stream): an
# open dashboard's readers are not theirs to have, however hard a digest is to reverse.
KEY_SECRETS = ("salt", "digest")
SCOPES = ("viewer", "admin")  # the ctl key scopes that open the dashboard
# What a request may see (``Dashboard._scope``): "admin", "viewer", "open", None for nothing.
SCOPE: web.RequestKey[str | None] = web.RequestKey("llmgw_dashboard_scope", object)  # type: ignore[arg-type]


def public(event: m.Event, *, admin: bool = False) -> Any:
    """An event as ``/api/status`` lists it: a key's salt and digest left out, where engines listen but to an admin."""
    doc = msgspec.to_builtins(event)
    if type(event) is m.KeyDeclared or (not admin and type(event) is m.ReplicaStateChanged):
        for name in KEY_SECRETS if type(event) is m.KeyDeclared else ("endpoint", "head_address"):
            doc.pop(name, None)
    return doc


class _Connection(CountedConnection):
    """A connection whose request aiohttp's parser refuses is answered with one line in the log, the
    request's quoted bytes left out (aiohttp's own logs a traceback quoting them, a malformed
    ``Authorization`` header's secret included)."""

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:  # the dashboard's own failure: aiohttp's answer and its traceback
            return super().handle_error(request, status, exc, message)
        reason = unreadable(exc, message)
        quiet = isinstance(exc, BadHttpMethod)  # not HTTP at all (TLS, a port scan): not worth a warning
        (log.debug if quiet else log.warning)("dashboard: unreadable request from %s: %s", request.remote, reason)
        resp = web.json_response({"error": f"the request could not be read: {reason}"}, status=status)
        resp.force_close()  # the parser has lost its place in the stream
        return resp


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """What one dashboard gives its clients: past a limit a client is refused or dropped, never waited on.

    ``idle_s`` is aiohttp's keep-alive timeout, which it arms when a connection
    opens and re-arms only after an answer: it closes a socket that has not sent
    a whole request within ``idle_s`` of connecting (however slowly it trickles
    bytes) or of its last answer. A request body (the login form) gets the same
    bound. ``write_s`` bounds each write: a page that does not take an update
    (or the page itself) within it is dropped, and its slot freed.
    """

    pages: int = 256  # live event streams at once, all addresses together; past it 503
    pages_per_client: int = 32  # live event streams from one address (an IPv6 /64); past it 429
    # Open sockets from one address, pages or not; past it a new one is closed at once (no file
    # descriptors left to the rest of the world by one host opening thousands).
    connections_per_client: int = 512
    idle_s: float = 10.0
    write_s: float = 10.0
    sessions: int = 1024  # logged-in sessions kept; past it the oldest is forgotten (it logs in again)
    session_ttl_s: float = 12 * 3600.0


class Sessions:
    """Logged-in browsers: random ids, each until it expires; past ``size`` the oldest is forgotten."""

    def __init__(self, size: int, ttl_s: float) -> None:
        self.size = max(1, size)
        self.ttl_s = ttl_s
        self._expires: OrderedDict[str, float] = OrderedDict()  # oldest first, and so soonest to expire
        self._who: dict[str, tuple[str, str]] = {}  # sid → (scope, lookup id of its ctl key; "" a file key)

    def __len__(self) -> int:
        return len(self._expires)

    def open(self, now: float, scope: str = "admin", key_id: str = "") -> str:
        while self._expires and next(iter(self._expires.values())) <= now:
            self._who.pop(self._expires.popitem(last=False)[0], None)
        sid = secrets.token_urlsafe(32)
        self._expires[sid] = now + self.ttl_s
        self._who[sid] = (scope, key_id)
        while len(self._expires) > self.size:
            self._who.pop(self._expires.popitem(last=False)[0], None)
        return sid

    def who(self, sid: str) -> tuple[str, str]:
        """(scope, ctl key id) of a session ``valid`` said is."""
        return self._who.get(sid, ("admin", ""))

    def valid(self, sid: str, now: float) -> bool:
        expires = self._expires.get(sid)
        if expires is None:
            return False
        if expires <= now:
            del self._expires[sid]
            self._who.pop(sid, None)
            return False
        return True

    def close(self, sid: str) -> None:
        self._expires.pop(sid, None)
        self._who.pop(sid, None)


# --- HTML, escaped by default ---------------------------------------------------------------


class Dashboard:
    """The dashboard's view of the fleet and its aiohttp app; ``start`` serves it, ``stop`` ends it."""

    def __init__(self, bus: Bus, *, api_keys: Iterable[str] = (), interval_s: float = 5.0, events: int = 50,
                 request_timeout_s: float = 5.0, limits: Limits | None = None) -> None:
        if interval_s <= 0:
            raise ConfigError(f"--interval must be positive (got {interval_s})")
        self.limits = limits or Limits()
        if bad := [f"{k}={v:g}" for k, v in msgspec.structs.asdict(self.limits).items() if v <= 0]:
            raise ConfigError(f"the dashboard's limits must be positive (got {', '.join(bad)})")
        self.bus = bus
        self.keys = tuple(api_keys)
        self.interval_s = interval_s
        self.max_events = max(1, events)
        self.request_timeout_s = request_timeout_s
        self.report: m.StatusReport | None = None
        self.ok = False
        self.why = "not asked yet"
        self.answered_at: float | None = None  # wall clock of the last answer
        self.asked = 0  # status requests made: what the projector pays
        self.events: list[m.Event] = []
        self.sections: dict[str, str] = render(None, (), ok=False, why=self.why, at=None)
        self.public_sections = self.sections  # the same, tenants' names and usage left out
        self.declared: dict[str, m.KeyDeclared] = {}  # the live ctl keys, by lookup id
        self.version = 0
        self.clients = 0  # live event streams: the pages being served
        self.per_client: Counter[str] = Counter()
        self.sockets = ClientSockets(self.limits.connections_per_client, "dashboard")  # open sockets per client
        self.sessions = Sessions(self.limits.sessions, self.limits.session_ttl_s)
        self.url = ""
        self._changed = asyncio.Condition()
        self._refresh_lock = asyncio.Lock()
        self._last_refresh = -1e9
        self._poke = asyncio.Event()  # a fleet or control event arrived: ask again soon
        self._behind: set[str] = set()  # streams whose latest events are not read yet; the first page waits
        self._tailed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None

    # --- what the page shows -----------------------------------------------------------------------

    async def refresh(self, max_age_s: float = MIN_GAP_S) -> None:
        """Ask the projector unless its last answer is younger than ``max_age_s`` (askers at once share one)."""
        async with self._refresh_lock:
            if time.monotonic() - self._last_refresh < max_age_s:
                return
            req = m.StatusRequest(idle_threshold_s=0, gpus=True, wait_s=0, replicas=True)
            self.asked += 1
            try:
                data = await self.bus.request(subjects.STATUS, m.encode(req), timeout=self.request_timeout_s,
                                              service="projector (llmgw project)")
                self.report = m.STATUS_REPORT_DECODER.decode(data)
                self.ok, self.why, self.answered_at = True, "", time.time()
            except NoServiceError:
                self.ok, self.why = False, "no projector answers on the bus"
            except LlmgwError as e:
                self.ok, self.why = False, str(e)
            except m.DECODE_ERRORS as e:
                self.ok, self.why = False, f"the projector's answer cannot be read ({e})"
            except Exception as e:  # noqa: BLE001 - the bus between reconnects, anything: the page says so
                self.ok, self.why = False, f"the bus: {e or type(e).__name__}"
            self._last_refresh = time.monotonic()
            await self._publish()

    async def _publish(self) -> None:
        events = list(reversed(self.events))
        sections = render(self.report, events, ok=self.ok, why=self.why, at=self.answered_at)
        public = render(self.report, events, ok=self.ok, why=self.why, at=self.answered_at, tenants=False)
        if sections != self.sections or public != self.public_sections:
            self.sections, self.public_sections = sections, public
            async with self._changed:
                self.version += 1
                self._changed.notify_all()

    def _keep(self, events: Iterable[m.Event]) -> None:
        self.events.extend(events)
        self.events.sort(key=lambda e: e.at)
        del self.events[:-self.max_events]

    async def _tail(self, stream: str, decoder: msgspec.json.Decoder[Any]) -> None:
        """The last events of a history stream, then every new one; a bus outage is waited out."""
        start: int | None = None
        delay = 0.5
        while True:
            try:
                if start is None:
                    last = await self.bus.stream_last_seq(stream)
                    start = max(1, last - self.max_events + 1)
                    if last == 0:
                        self._caught_up(stream)
                follower = self.bus.follow(stream, decoder, start, who="dashboard")
                try:
                    async for batch in follower.batches():
                        self._keep(d.event for d in batch)
                        if stream in self._behind and follower.last_seq >= last:
                            self._caught_up(stream)
                        delay = 0.5
                        if self.clients:
                            self._poke.set()  # the fleet changed: what status says has too
                            await self._publish()
                finally:
                    start = follower.last_seq + 1
            except BusError as e:
                log.warning("dashboard: reading %s: %s; again in %.1fs", stream, e, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    async def _follow_keys(self) -> None:
        """Every live ctl key, from the control stream's first event on (a key is older than its tail)."""
        prefix = f"{subjects.PREFIX}.control.key."
        start, delay = 1, 0.5
        while True:
            try:
                last = await self.bus.stream_last_seq(subjects.STREAM_CONTROL)
                if last < start:
                    self._caught_up("keys")
                follower = self.bus.follow(subjects.STREAM_CONTROL, m.CONTROL_DECODER, start, who="dashboard-keys",
                                           keep=lambda raw: raw.subject.startswith(prefix))
                try:
                    async for batch in follower.batches():
                        for d in batch:
                            match d.event:
                                case m.KeyDeclared() as key:
                                    self.declared = {i: k for i, k in self.declared.items() if k.name != key.name}
                                    self.declared[key.lookup_id] = key
                                case m.KeyRevoked(name=name):
                                    self.declared = {i: k for i, k in self.declared.items() if k.name != name}
                        if follower.last_seq >= last:
                            self._caught_up("keys")
                        delay = 0.5
                        async with self._changed:
                            self.version += 1  # every page looks again whether its key still opens it
                            self._changed.notify_all()
                finally:
                    start = follower.last_seq + 1
            except BusError as e:
                log.warning("dashboard: reading the keys: %s; again in %.1fs", e, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    def _caught_up(self, stream: str) -> None:
        self._behind.discard(stream)
        if not self._behind:
            self._tailed.set()

    async def _poll(self) -> None:
        while True:
            self._poke.clear()
            if self.clients:
                await self.refresh()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._poke.wait()
            await asyncio.sleep(max(0.0, self._last_refresh + MIN_GAP_S - time.monotonic()))

    # --- HTTP -------------------------------------------------------------------------------------------

    def _live(self, key: m.KeyDeclared | None) -> bool:
        return key is not None and key.scope in SCOPES and (key.expires_at is None or key.expires_at > m.utcnow())

    @property
    def login_required(self) -> bool:
        """Whether the page asks for a key: once any key may open it (the file's, a viewer's, an admin's)."""
        return bool(self.keys) or any(self._live(k) for k in self.declared.values())

    def _session(self, request: web.Request) -> str | None:
        """The request's session id, if this dashboard gave it out, it has not expired and its key still opens it."""
        sid = request.cookies.get(COOKIE, "")
        if not sid or not self.sessions.valid(sid, time.monotonic()):
            return None
        _, key_id = self.sessions.who(sid)
        if key_id and not self._live(self.declared.get(key_id)):  # revoked, expired or no longer a viewer's
            self.sessions.close(sid)
            return None
        return sid

    def _scope(self, request: web.Request) -> str | None:
        """What the request may see: "admin", "viewer", "open" (no key exists that could open it), None: nothing."""
        if not self.login_required:
            return "open"
        scheme, _, key = request.headers.get("Authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer":
            found = self._key(key.strip())
            return found[0] if found else None
        sid = self._session(request)
        return self.sessions.who(sid)[0] if sid is not None else None

    def _key(self, key: str) -> tuple[str, str] | None:
        """(scope, ctl key id; "" for a file key) of a key that may open the dashboard."""
        if not key:
            return None
        if key.startswith(m.KEY_PREFIX):  # a ctl key: found by the id in it, checked by its salted digest
            found = self.declared.get(key[len(m.KEY_PREFIX):len(m.KEY_PREFIX) + 16])
            salt, expected = (found.salt, found.digest) if found is not None else ("00" * 16, "0" * 64)
            got = hashlib.sha256(bytes.fromhex(salt) + key.encode(errors="replace")[:512]).hexdigest()
            if not hmac.compare_digest(got, expected) or found is None or not self._live(found):
                return None
            return found.scope, found.lookup_id
        digest = hashlib.sha256(key.encode()).hexdigest()
        ok = False
        for k in self.keys:  # every key compared, so timing says nothing about which matched
            ok |= hmac.compare_digest(digest, k)
        return ("admin", "") if ok else None

    @web.middleware
    async def _guard(self, request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        public = request.path.startswith("/static/") or request.path in ("/login", "/logout")
        request[SCOPE] = scope = self._scope(request)
        if not public and scope is None:
            if request.path == "/":
                resp: web.StreamResponse = web.Response(status=401, text=login_page(), content_type="text/html")
                if OLD_COOKIE in request.cookies:  # the key itself, from before sessions: no longer sent
                    resp.del_cookie(OLD_COOKIE, path="/")
            else:
                resp = web.json_response({"error": "missing or invalid API key; send `Authorization: Bearer <key>`"},
                                         status=401)
        else:
            resp = await handler(request)
        if not resp.prepared:  # an event stream sent its own
            resp.headers.update(SECURITY_HEADERS)
            try:
                async with asyncio.timeout(self.limits.write_s):
                    await resp.prepare(request)
                    await resp.write_eof()
            except TimeoutError:
                self._drop(request, "its answer")
            except ConnectionError:
                pass  # it went away: aiohttp finds so too, and says nothing
        return resp

    def _drop(self, request: web.Request, what: str) -> None:
        """Close a client that did not take ``what`` within ``write_s``; what it was sent is thrown away."""
        log.debug("dashboard: %s did not take %s within %gs; dropped", request.remote, what, self.limits.write_s)
        if request.transport is not None:
            request.transport.abort()

    async def _index(self, request: web.Request) -> web.Response:
        # The first page right after a start: not "no events yet" while the latest are being read.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FIRST_EVENTS_WAIT_S):
                await self._tailed.wait()
        self._tailed.set()  # only the first page ever waits (a bus away at start must not slow every page)
        if not self.clients:  # nobody polls while no page is open: ask now
            await self.refresh()
        sections = self.sections if request[SCOPE] == "admin" else self.public_sections
        body = page(sections, logout=self.login_required and self._session(request) is not None)
        return web.Response(text=body, content_type="text/html", headers={"Cache-Control": "no-store"})

    async def _login(self, request: web.Request) -> web.Response:
        try:
            async with asyncio.timeout(self.limits.idle_s):
                form = await request.post()
        except TimeoutError:
            late = web.Response(status=408, text=f"the login form did not arrive within {self.limits.idle_s:g}s; "
                                                 "send it again")
            late.force_close()
            return late
        key = str(form.get("key", "")).strip()
        found = self._key(key)
        if found is None:
            return web.Response(status=401, text=login_page("that key is not accepted: give the --api-keys file's, or "
                                                            "a key of `llmgw ctl key create NAME --scope viewer` "
                                                            "(or admin)"), content_type="text/html")
        resp = web.Response(status=303, headers={"Location": "./"})
        # The browser keeps a random id; the server alone knows it stands for a good key.
        resp.set_cookie(COOKIE, self.sessions.open(time.monotonic(), *found), httponly=True, samesite="Strict",
                        secure=request.secure, path="/", max_age=int(self.limits.session_ttl_s))
        if OLD_COOKIE in request.cookies:
            resp.del_cookie(OLD_COOKIE, path="/")
        return resp

    async def _logout(self, request: web.Request) -> web.Response:
        sid = request.cookies.get(COOKIE, "")
        if sid:
            self.sessions.close(sid)
            async with self._changed:
                self._changed.notify_all()  # its open pages are told now, not at their next keep-alive
        resp = web.Response(status=303, headers={"Location": "./"})
        resp.del_cookie(COOKIE, path="/")
        if OLD_COOKIE in request.cookies:
            resp.del_cookie(OLD_COOKIE, path="/")
        return resp

    async def _static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound()
        body = resources.files("llmgw.dashboard").joinpath("static", name).read_bytes()
        return web.Response(body=body, content_type=STATIC[name], headers={"Cache-Control": "max-age=300"})

    async def _status(self, request: web.Request) -> web.Response:
        """The same data as the page, as JSON, for scripts."""
        if not self.clients:
            await self.refresh()
        report, events = self.report, list(reversed(self.events))
        if not (admin := request[SCOPE] == "admin"):  # tenants, keys' records, engines' addresses: an admin's alone
            if report is not None:
                report = msgspec.structs.replace(report, tenants=(), near_limits=(), replica_list=tuple(
                    msgspec.structs.replace(r, endpoint="") for r in report.replica_list))
        body = {"live": self.ok, "problem": self.why, "report": msgspec.to_builtins(report), "scope": request[SCOPE],
                "events": [public(e, admin=admin) for e in events if admin or type(e) not in (m.KeyDeclared, m.KeyRevoked)]}
        return web.json_response(body, dumps=lambda x: json.dumps(x, default=str))

    def _refusal(self, client: str) -> web.Response | None:
        """Why a new page is not served now, if it is not: one address's share first, then the whole cap."""
        if self.per_client[client] >= self.limits.pages_per_client:
            return web.Response(status=429, text=f"{self.limits.pages_per_client} pages are open from {client} "
                                                 "already, the most one address may have; close one")
        if self.clients >= self.limits.pages:
            return web.Response(status=503, text=f"{self.limits.pages} pages are open already, the most this "
                                                 "dashboard serves; close one")
        return None

    async def _write(self, request: web.Request, resp: web.StreamResponse, data: bytes) -> None:
        """One write of an event stream; a page that does not take it within ``write_s`` is dropped."""
        try:
            async with asyncio.timeout(self.limits.write_s):
                if not resp.prepared:
                    await resp.prepare(request)
                await resp.write(data)
        except TimeoutError:
            self._drop(request, "an update")
            raise ConnectionResetError("dropped: it reads too slowly") from None

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """Server-Sent Events: the sections that changed, whenever something did."""
        client = client_of(request.remote)
        refused = self._refusal(client)
        if refused is not None:
            return refused
        # Counted before the first await, so streams opening at once cannot all pass the check.
        self.clients += 1
        self.per_client[client] += 1
        sid = self._session(request) if self.login_required else None
        admin = request[SCOPE] == "admin"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                           "X-Accel-Buffering": "no"})
        resp.headers.update(SECURITY_HEADERS)
        sent: dict[str, str] = {}
        seen = -1
        try:
            await self._write(request, resp, b"retry: 2000\n\n")  # the browser's wait before it reconnects
            if time.monotonic() - self._last_refresh >= self.interval_s:
                self._poke.set()
            while True:
                if (sid is not None and self._session(request) is None) or (sid is None and self.login_required
                                                                               and self._scope(request) is None):
                    await self._write(request, resp, b"event: logout\ndata: {}\n\n")  # the page asks for the key
                    break
                sections = self.sections if admin else self.public_sections
                changed = {k: v for k, v in sections.items() if sent.get(k) != v}
                seen = self.version
                if changed:
                    data = json.dumps({"v": seen, "sections": changed})
                    await self._write(request, resp, f"event: update\ndata: {data}\n\n".encode())
                    sent.update(changed)
                async with self._changed:
                    try:
                        async with asyncio.timeout(15):
                            await self._changed.wait_for(self._woken(seen, sid))
                        quiet = False
                    except TimeoutError:
                        quiet = True
                if quiet:  # written outside the lock: a page that reads nothing must not hold up the others
                    await self._write(request, resp, b": keep-alive\n\n")
        except ConnectionError:
            pass  # the page went away, or was dropped
        finally:
            self.clients -= 1
            self.per_client[client] -= 1
            if not self.per_client[client]:
                del self.per_client[client]
        return resp

    def _woken(self, version: int, sid: str | None) -> Callable[[], bool]:
        return lambda: self.version != version or (sid is not None and not self.sessions.valid(sid, time.monotonic()))

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=16 * 1024)  # a login form at most
        app.router.add_get("/", self._index)
        app.router.add_post("/login", self._login)
        app.router.add_post("/logout", self._logout)
        app.router.add_get("/events", self._events)
        app.router.add_get("/api/status", self._status)
        app.router.add_get("/static/{name}", self._static)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Follow the streams, ask the projector, listen; returns the page's URL."""
        self._behind = {subjects.STREAM_FLEET, subjects.STREAM_CONTROL, "keys"}
        self._tasks = [asyncio.create_task(self._tail(subjects.STREAM_FLEET, m.FLEET_DECODER), name="dash-fleet"),
                       asyncio.create_task(self._tail(subjects.STREAM_CONTROL, m.CONTROL_DECODER), name="dash-control"),
                       asyncio.create_task(self._follow_keys(), name="dash-keys"),
                       asyncio.create_task(self._poll(), name="dash-poll")]
        # handler_cancellation: a page that closes ends its event stream at once, not at the next write.
        # keepalive_timeout (on each connection, below): armed when a socket opens, so one that never
        # finishes a request is closed too; lingering_time: an unread request body is waited for no longer.
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False, handler_cancellation=True,
                                     shutdown_timeout=1)
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()

        def connection() -> _Connection:
            return _Connection(server, self.sockets, loop=loop, access_log=None,
                                     keepalive_timeout=self.limits.idle_s, lingering_time=self.limits.idle_s)

        try:
            self._listener = await loop.create_server(connection, host or None, port, backlog=1024)
        except OSError as e:
            await self.stop()
            raise ConfigError(f"the dashboard cannot listen on {host}:{port} ({e.strerror}); pick another "
                              "--listen (port 0 picks a free one)") from e
        bound = self._listener.sockets[0].getsockname()[1]
        shown = f"[{host}]" if ":" in host else ("127.0.0.1" if host in ("", "0.0.0.0") else host)
        self.url = f"http://{shown}:{bound}/"
        return self.url

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        if self._listener is not None:
            self._listener.close()  # no new sockets; the runner's cleanup closes the open ones
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
