"""The router under hostile HTTP clients: slow-loris, header injection, smuggling; other requests unaffected."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
from running import until

from llmgw.bus import Bus
from llmgw.bus.server import EmbeddedServer, free_port
from llmgw.config import Settings
from llmgw.router.server import Router

pytestmark = pytest.mark.slow


@pytest.fixture
async def router(bus: Bus) -> AsyncIterator[Router]:
    r = Router(bus, "router-hostile", tick_s=3600, max_body_bytes=64 * 1024)
    await r.start("127.0.0.1", 0)
    try:
        yield r
    finally:
        await r.stop()


async def closed(writer: asyncio.StreamWriter) -> None:
    """Close a raw connection and wait until its socket is, so none is left for the GC to warn about."""
    writer.close()
    with contextlib.suppress(OSError):  # the router may have reset it first
        await writer.wait_closed()


async def raw(router: Router, data: bytes, limit_s: float = 10) -> bytes:
    """Send raw bytes, return whatever the router answers before it closes (bounded)."""
    u = urlsplit(router.url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    try:
        writer.write(data)
        await writer.drain()
        out = b""
        async with asyncio.timeout(limit_s):
            while chunk := await reader.read(65536):  # every request says Connection: close
                out += chunk
        return out
    finally:
        await closed(writer)


async def models_ok(router: Router) -> int:
    async with aiohttp.ClientSession() as s, s.get(router.url + "/v1/models") as resp:
        return resp.status


async def test_slow_loris_clients_do_not_block_others(router: Router, record: Callable[..., None]) -> None:
    u = urlsplit(router.url)
    lorises = []
    for _ in range(50):  # each sends half a request line and then nothing
        r, w = await asyncio.open_connection(u.hostname, u.port)
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\":")
        await w.drain()
        lorises.append((r, w))
    statuses = await asyncio.gather(*(models_ok(router) for _ in range(20)))
    for _, w in lorises:
        await closed(w)
    assert statuses == [200] * 20
    record(slow_clients=len(lorises), other_requests=len(statuses), other_ok=statuses.count(200))


def post(headers: bytes, body: bytes, length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + headers
            + f"Content-Length: {n}\r\n\r\n".encode() + body)


HOSTILE = {
    # A header value with a bare CR: refused by the HTTP parser, nothing forwarded.
    "bare-cr-in-header": (post(b"X-A: a\rInjected: 1\r\n", b"{}"), 400),
    # Request smuggling: Content-Length and Transfer-Encoding together.
    "cl-and-te": (post(b"Transfer-Encoding: chunked\r\n", b"0\r\n\r\n"), 400),
    # A model name carrying CRLF and a header: a clear JSON 404, never a header.
    "crlf-in-model": (post(b"", b'{"model":"m\\r\\nX-Injected: yes","messages":[]}'), 404),
    # A body larger than the limit: 413, and the router is not bothered.
    "huge-body": (post(b"", b'{"model":"m","pad":"' + b"x" * 200_000 + b'"}'), 413),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_hostile_requests_get_4xx_and_inject_nothing(router: Router, case: str) -> None:
    request_bytes, status = HOSTILE[case]
    out = await raw(router, request_bytes)
    head = out.split(b"\r\n\r\n", 1)[0]
    assert re.match(rb"HTTP/1\.[01] " + str(status).encode(), head), out[:300]
    assert b"x-injected" not in head.lower() and b"\ninjected" not in head.lower()
    assert await models_ok(router) == 200


async def test_a_body_that_stops_halfway_gets_408_and_the_connection_closes(bus: Bus) -> None:
    r = Router(bus, "router-body-timeout", tick_s=3600, body_timeout_s=0.5)
    await r.start("127.0.0.1", 0)
    try:
        u = urlsplit(r.url)
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\":")
        await writer.drain()
        out = b""
        async with asyncio.timeout(10):  # bounded: the router must answer by itself
            while b'"code":"request_timeout"' not in out and (chunk := await reader.read(65536)):
                out += chunk
        await closed(writer)
        assert out.startswith(b"HTTP/1.1 408"), out[:200]
        assert b"Connection: close" in out  # the rest of that body is never read as a request
        assert await models_ok(r) == 200
    finally:
        await r.stop()


async def test_an_announced_oversized_body_gets_413_before_it_is_sent(router: Router) -> None:
    u = urlsplit(router.url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    # Headers only: a Content-Length far above the 64 KiB limit, and no body at all.
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n")
    await writer.drain()
    out = b""
    async with asyncio.timeout(10):
        while b'"code":"request_too_large"' not in out and (chunk := await reader.read(65536)):
            out += chunk
    await closed(writer)
    assert out.startswith(b"HTTP/1.1 413"), out[:200]


async def test_slow_request_heads_are_closed_after_the_header_timeout(bus: Bus, record: Callable[..., None]) -> None:
    r = Router(bus, "router-heads", tick_s=3600, header_timeout_s=1.0)
    await r.start("127.0.0.1", 0)
    u = urlsplit(r.url)
    conns = []
    try:
        for _ in range(10):
            reader, writer = await asyncio.open_connection(u.hostname, u.port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            conns.append((reader, writer))

        async def drip_until_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
            """One header line every 0.3 s, as slow-loris does; True once the router closed the socket."""
            for i in range(30):
                try:
                    writer.write(f"X-Drip-{i}: {i}\r\n".encode())
                    await writer.drain()
                except ConnectionError:
                    return True
                try:
                    if await asyncio.wait_for(reader.read(1024), 0.3) == b"":
                        return True
                except TimeoutError:
                    continue
                except ConnectionError:
                    return True
            return False  # still open after 9 s of dripping

        closed_by_router = await asyncio.gather(*(drip_until_closed(rd, w) for rd, w in conns))
        assert await models_ok(r) == 200  # and the router serves on
    finally:
        for _, w in conns:
            await closed(w)
        await r.stop()
    assert closed_by_router == [True] * len(conns)
    record(slow_heads=len(conns), closed=closed_by_router.count(True))


async def test_health_says_degraded_while_the_bus_is_down(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path / "data", port=free_port()).start()
    bus = await Bus.connect(Settings(nats_url=server.url, connect_timeout_s=2, request_timeout_s=2), "router-bus")
    r = Router(bus, "router-bus", tick_s=3600)
    try:
        await bus.ensure_streams()
        await r.start("127.0.0.1", 0)

        async def health() -> tuple[int, dict[str, object]]:
            async with aiohttp.ClientSession() as s, s.get(r.url + "/health") as resp:
                return resp.status, await resp.json()

        status, body = await health()
        assert (status, body["status"], body["bus"]) == (200, "ok", "up")
        server.kill()
        await until(lambda: not bus.nc.is_connected, "the router's connection noticing", 10)
        status, body = await health()
        assert (status, body["status"], body["bus"]) == (200, "degraded", "down")  # it still serves what it knew
        server.start()
        await until(lambda: bus.nc.is_connected, "the router reconnecting", 20)
        status, body = await health()
        assert (status, body["status"], body["bus"]) == (200, "ok", "up")
    finally:
        await r.stop()
        await bus.close()
        server.stop()
