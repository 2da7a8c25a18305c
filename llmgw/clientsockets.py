"""Open sockets per client, for the dashboard and the router: one host cannot hold every file descriptor.

A client is an IPv4 address or an IPv6 /64 (one host is given a whole /64). Past ``cap``
open sockets from one client a new one is closed before a byte is read; 0 is no cap
(behind a load balancer every socket is the balancer's).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
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
