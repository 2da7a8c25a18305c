"""The one outbound HTTP edge towards engines: the router's proxying and the agents' health checks.

Two clients, each created once per process (keep-alive connections to the engines are what
keeps added latency low): the router proxies requests through ``proxy``, on llmgw's own
HTTP/1.1 client (``http1``: aiohttp's client was the largest single cost of a proxied request);
everything else (an agent's health checks and reads of what an engine reserved, the router's
adapter loads and lists) goes through one aiohttp ClientSession, with a total bound per call.

Every engine llmgw starts asks for its own API key (``EngineKeyIssued``): ``keys`` says which key an
endpoint takes, and every request through this client to that endpoint carries it as
``Authorization: Bearer <key>`` (proxied requests, health checks, metrics, adapter loads alike).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from yarl import URL

from llmgw.engine.http1 import USER_AGENT, Answer, Client, EngineBrokeOff, EngineUnreachable

__all__ = ["CONNECT_ERRORS", "READ_ERRORS", "USER_AGENT", "Answer", "Timeouts", "Upstream"]

# Errors that mean the request never reached an engine that could answer it:
# nothing was sent to the client yet, so another replica may try.
# A connect timeout (aiohttp >= 3.10 tells it apart from a read timeout) counts too.
_CONNECT_TIMEOUT: tuple[type[BaseException], ...] = (
    (aiohttp.ConnectionTimeoutError,) if hasattr(aiohttp, "ConnectionTimeoutError") else ()
)
CONNECT_ERRORS: tuple[type[BaseException], ...] = (
    EngineUnreachable,
    aiohttp.ClientConnectorError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    *_CONNECT_TIMEOUT,
)

# Errors while reading an answer that has begun.
READ_ERRORS: tuple[type[BaseException], ...] = (
    EngineBrokeOff,
    aiohttp.ClientPayloadError,
    aiohttp.ClientConnectionError,
    TimeoutError,
)


@dataclass(frozen=True)
class Timeouts:
    """Every upstream wait is bounded: connecting, and each read (headers, each chunk)."""

    connect_s: float = 5.0
    read_s: float = 300.0


class Upstream:
    """A shared aiohttp session towards the engines."""

    def __init__(self, timeouts: Timeouts | None = None, *, max_connections: int = 0,
                 keys: Callable[[str], str | None] | None = None) -> None:
        self.timeouts = timeouts or Timeouts()
        # The API key an endpoint's engine takes (None: none known, the request goes without).
        self.keys = keys
        self._max = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._proxy: Client | None = None
        # Parsed once per (endpoint, route): yarl parsing is a visible share of a proxied request.
        self._urls: dict[tuple[str, str], URL] = {}
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=self.timeouts.connect_s, sock_connect=self.timeouts.connect_s,
            sock_read=self.timeouts.read_s,
        )

    async def start(self) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max, limit_per_host=0, keepalive_timeout=30,
                                             enable_cleanup_closed=False)
            self._session = aiohttp.ClientSession(
                # No cookie jar: an engine's cookie is not the router's to keep and send with the next
                # client's request, and filtering the jar is per-request work for nothing.
                connector=connector, timeout=self._timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                # Said once here, not skipped: aiohttp's skip_auto_headers builds and copies a header
                # map on every request. An answer must come back as the engine wrote it (identity):
                # the router passes its bytes on and never decompresses them.
                headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"},
            )
        if self._proxy is None:
            self._proxy = Client(self.timeouts.connect_s, self.timeouts.read_s)

    async def close(self) -> None:
        if self._proxy is not None:
            await self._proxy.close()
            self._proxy = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _url(self, endpoint: str, route: str) -> URL:
        url = self._urls.get((endpoint, route))
        if url is None:
            if len(self._urls) > 10_000:
                self._urls.clear()  # endpoints come and go; never grow without bound
            url = self._urls[(endpoint, route)] = URL(endpoint + route)
        return url

    def _with_key(self, endpoint: str, headers: dict[str, str] | None) -> dict[str, str] | None:
        key = self.keys(endpoint) if self.keys is not None else None
        if key is None:
            return headers
        return {**(headers or {}), "Authorization": f"Bearer {key}"}

    def _complete(self, endpoint: str, headers: dict[str, str]) -> None:
        """``headers`` completed in place with the key ``endpoint`` takes: a retry on another replica
        sends that one's key, or none."""
        key = self.keys(endpoint) if self.keys is not None else None
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        elif "Authorization" in headers:
            del headers["Authorization"]

    async def proxy(self, endpoint: str, route: str, body: bytes, headers: dict[str, str]) -> Answer:
        """A client's request on its way to an engine: POST ``body`` to ``endpoint + route``, the answer
        once its head came (``http1``). ``headers`` is completed with the engine's key, as by ``post``."""
        assert self._proxy is not None, "Upstream.start() was not awaited"
        self._complete(endpoint, headers)
        return await self._proxy.post(endpoint, route, body, headers)

    def post(self, endpoint: str, route: str, body: bytes, headers: dict[str, str], *,
             total_s: float | None = None) -> aiohttp.client._RequestContextManager:
        """POST ``body`` to ``endpoint + route``; await it for the response once headers arrived.
        ``total_s`` bounds the whole exchange (a health check), on top of the session's timeouts.

        ``headers`` is the caller's, completed here (not copied) with the key ``endpoint`` takes:
        a retry on another replica sends that one's key, or none."""
        assert self._session is not None, "Upstream.start() was not awaited"
        url = self._url(endpoint, route)
        self._complete(endpoint, headers)
        if total_s is None:
            return self._session.post(url, data=body, headers=headers)
        return self._session.post(url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=total_s))

    def get(self, endpoint: str, route: str, *, total_s: float | None = None) -> aiohttp.client._RequestContextManager:
        """GET ``endpoint + route`` (health, metrics, props), bounded like ``post``."""
        assert self._session is not None, "Upstream.start() was not awaited"
        url = self._url(endpoint, route)
        headers = self._with_key(endpoint, None)
        if total_s is None:
            return self._session.get(url, headers=headers)
        return self._session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=total_s))
