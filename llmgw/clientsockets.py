"""Open sockets per client, for the dashboard and the router: one host cannot hold every file descriptor.

A client is an IPv4 address or an IPv6 /64 (one host is given a whole /64). Past ``cap``
open sockets from one client a new one is closed before a byte is read; 0 is no cap
(behind a load balancer every socket is the balancer's).

And what a request their parser refused may put in a log line: never a credential.
aiohttp's parser quotes the line it choked on (``Invalid header value char: b'Authorization:
Bearer sk-…\\x01'``), or just the value (``Got more than 8190 bytes when reading: b'Bearer
sk-…'``): a malformed ``Authorization`` header would otherwise write the caller's whole secret
into the router's or the dashboard's log, and into the 400 it answers. So every quoted piece of
the request is cut to its header name (a bare value or request line to its length), and
whatever follows a word that introduces a credential is dropped.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
from collections import Counter
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)


def client_of(remote: str | None) -> str:
    """Whom a socket counts against: its IPv4 address, or its IPv6 /64."""
    if not remote:
        return "unknown"
    try:
        addr = ipaddress.ip_address(remote)
    except ValueError:
        return remote
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


class ClientSockets:
    """How many sockets each client holds open, and how many were closed for being past ``cap``."""

    def __init__(self, cap: int, who: str) -> None:
        self.cap = cap  # 0: no cap
        self.who = who  # for the log: "dashboard", "router r1"
        self.open: Counter[str] = Counter()
        self.refused = 0

    def admit(self, transport: asyncio.BaseTransport) -> str | None:
        """The client a new socket counts against, or None when it was closed for being one too many."""
        peer = transport.get_extra_info("peername")
        client = client_of(peer[0] if isinstance(peer, tuple) and peer else None)
        if self.cap and self.open[client] >= self.cap:
            self.refused += 1
            log.debug("%s: %s has %d sockets open already; closed another", self.who, client, self.open[client])
            if isinstance(transport, asyncio.WriteTransport):
                transport.abort()  # at once: nothing was read, nothing is owed
            else:
                transport.close()
            return None
        self.open[client] += 1
        return client

    def release(self, client: str) -> None:
        self.open[client] -= 1
        if not self.open[client]:
            del self.open[client]


class CountedConnection(web.RequestHandler):
    """aiohttp's connection handler, counted in ``sockets`` (and closed at once past its cap)."""

    def __init__(self, manager: web.Server, sockets: ClientSockets, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._sockets = sockets
        self._client: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._client = self._sockets.admit(transport)
        if self._client is not None:
            super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        client, self._client = self._client, None
        if client is None:
            return  # refused in connection_made: aiohttp never saw it
        self._sockets.release(client)
        super().connection_lost(exc)


# --- what a refused request may put in the log ---------------------------------------

MAX_REASON = 200
# A Python literal of the client's bytes (or text) as a parser quotes it, escapes included.
_QUOTED = re.compile(r"""b?(['"])(?:\\.|(?!\1).)*?\1""", re.DOTALL)
_NAME = re.compile(r"([!#$%&*+\-.^_`|~0-9A-Za-z]{1,64})\s*:")
# Anything after these, up to the end of the line, may be a credential.
_CREDENTIAL = re.compile(r"(?i)\b(proxy-authorization|authorization|bearer|basic|digest|cookie|api[-_]?key)\b(?!: … not logged\]).*")


def _quoted(match: re.Match[str]) -> str:
    inner = match.group(0)[1:-1] if match.group(0)[0] in "'\"" else match.group(0)[2:-1]
    name = _NAME.match(inner)
    return f"[{name.group(1)}: … not logged]" if name else f"[{len(inner)} characters not logged]"


def redacted(text: str) -> str:
    """``text`` on one line with no piece of the request it quotes and nothing after a credential's name."""
    text = _QUOTED.sub(_quoted, " ".join(str(text).split()))
    return _CREDENTIAL.sub(lambda mt: f"{mt.group(1)} … (not logged)", text)


def unreadable(exc: BaseException | None, message: str | None = None) -> str:
    """What aiohttp's parser said about a request, on one bounded line, with what it quoted of the request
    left out (it may hold a credential)."""
    cause = exc.__cause__ if isinstance(exc, web.RequestPayloadError) and exc.__cause__ else exc
    text = message or getattr(cause, "message", "") or str(cause or "") or type(cause).__name__
    return redacted(str(text))[:MAX_REASON]
