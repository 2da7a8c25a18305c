"""The dashboard under abuse, over real sockets: one address cannot take every page, idle and
slow sockets are dropped after a bound, and the cookie holds a session id, never the key.

Clients come from 127.0.0.2 and 127.0.0.3 (all of 127/8 is loopback) so the dashboard sees
two addresses; every socket is closed in a ``finally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import socket
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
import pytest
from projection_events import t
from running import until
from streams import publish
from test_dashboard import serving

from llmgw import messages as m
from llmgw.apikeys import hash_key
from llmgw.bus import Bus
from llmgw.dashboard.app import Limits, Sessions, client_of

HOG, OTHER, THIRD = "127.0.0.2", "127.0.0.3", "127.0.0.4"


@contextlib.asynccontextmanager
async def from_address(addr: str) -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client whose connections come from ``addr`` (and are not capped by the client's own pool)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(addr, 0), limit=0)) as http:
        yield http


def where(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


async def open_streams(http: aiohttp.ClientSession, url: str, at_most: int,
                       held: list[aiohttp.ClientResponse]) -> aiohttp.ClientResponse | None:
    """Open event streams until one is refused (returned, with its body read) or ``at_most`` are open."""
    for _ in range(at_most):
        r = await http.get(url + "events")
        if r.status != 200:
            await r.read()
            r.close()
            return r
        held.append(r)
    return None


async def test_one_address_cannot_take_every_page(bus: Bus) -> None:
    limits = Limits()
    held: list[aiohttp.ClientResponse] = []
    async with serving(bus) as board, from_address(HOG) as hog, from_address(OTHER) as other:
        try:
            # One address opens streams as fast as it can (it never reads them), past the whole cap.
            refused = await open_streams(hog, board.url, limits.pages + 1, held)
            assert refused is not None, "nothing refused a page past the cap"
            # Someone else still gets a page.
            r = await other.get(board.url + "events")
            held.append(r)
            assert r.status == 200, await r.text()
            # The hog got its share and one line saying why not more.
            assert len(held) - 1 == limits.pages_per_client
            assert refused.status == 429
            assert await refused.text() == (f"{limits.pages_per_client} pages are open from {HOG} already, the most "
                                            "one address may have; close one")
            assert board.clients == limits.pages_per_client + 1
        finally:
            for r in held:
                r.close()
        await until(lambda: board.clients == 0, "the pages to close")


async def test_past_the_page_cap_everyone_is_told_so(bus: Bus) -> None:
    held: list[aiohttp.ClientResponse] = []
    async with serving(bus, limits=Limits(pages=3, pages_per_client=2)) as board, \
            from_address(HOG) as hog, from_address(OTHER) as other, from_address(THIRD) as third:
        try:
            assert await open_streams(hog, board.url, 2, held) is None
            assert await open_streams(other, board.url, 1, held) is None
            refused = await open_streams(third, board.url, 1, held)
            assert refused is not None and refused.status == 503
            assert await refused.text() == "3 pages are open already, the most this dashboard serves; close one"
            held.pop().close()  # one closes: its slot is free again
            await until(lambda: board.clients == 2, "the page to close")
            assert await open_streams(third, board.url, 1, held) is None
        finally:
            for r in held:
                r.close()


async def slowloris(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """A request whose headers never end: a header line every 0.2 s; what came back before the server closed."""
    writer.write(b"GET /events HTTP/1.1\r\nHost: x\r\n")
    got = b""
    with contextlib.suppress(ConnectionError):
        for _ in range(100):  # 20 s at most
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.2):
                    chunk = await reader.read(65536)
                    if not chunk:
                        return got
                    got += chunk
            writer.write(b"X-Slow: 1\r\n")
        raise AssertionError("a request that never ended its headers was kept open for 20 s")
    return got


async def test_idle_and_unfinished_requests_hold_no_page_and_are_closed(bus: Bus) -> None:
    limits = Limits(idle_s=1.0)
    async with serving(bus, limits=limits) as board, from_address(OTHER) as other:
        host, port = where(board.url)
        conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        try:
            for i in range(limits.pages + 8):  # more sockets than there are pages
                reader, writer = await asyncio.open_connection(host, port, local_addr=(HOG, 0))
                conns.append((reader, writer))
                if i % 4 == 1:  # headers that never end
                    writer.write(b"GET /events HTTP/1.1\r\nHost: x\r\n")
                elif i % 4 == 2:  # a page, then nothing (an idle keep-alive connection)
                    writer.write(b"GET /static/dashboard.css HTTP/1.1\r\nHost: x\r\n\r\n")
                elif i % 4 == 3:  # a login form whose body never arrives
                    writer.write(b"POST /login HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded"
                                 b"\r\nContent-Length: 100\r\n\r\nkey=")
            # None of them is a page: a page from elsewhere is served.
            async with other.get(board.url + "events") as r:
                assert r.status == 200 and board.clients == 1
            # Every one of them is closed by the dashboard, and one that keeps trickling header lines too.
            loris = await asyncio.open_connection(host, port, local_addr=(HOG, 0))
            conns.append(loris)
            async with asyncio.timeout(15):
                trickled = await slowloris(*loris)
                got = await asyncio.gather(*(reader.read() for reader, _ in conns[:-1]))
            assert trickled == b""
            for i, answer in enumerate(got):
                first = answer.split(b"\r\n", 1)[0]
                if i % 4 == 2:
                    assert first == b"HTTP/1.1 200 OK", answer[:200]
                elif i % 4 == 3:
                    assert first == b"HTTP/1.1 408 Request Timeout", answer[:200]
                    assert answer.endswith(b"the login form did not arrive within 1s; send it again"), answer
                else:
                    assert answer == b"", answer[:200]
        finally:
            for _, writer in conns:
                writer.close()


async def test_a_page_that_reads_nothing_is_dropped(bus: Bus) -> None:
    async with serving(bus, limits=Limits(write_s=0.5)) as board:
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, never emptied
            sock.setblocking(False)
            await loop.sock_connect(sock, where(board.url))
            await loop.sock_sendall(sock, b"GET /events HTTP/1.1\r\nHost: x\r\n\r\n")
            await until(lambda: board.clients == 1, "the event stream")
            # Each event is 16 KiB on the page (4 KiB of "<", escaped) and each update sends the whole timeline:
            # soon more than any socket buffer holds.
            for i in range(100):
                if board.clients == 0:
                    break
                await publish(bus, [m.ModelUnplaceable(at=t(i), name=f"m{i}", reason="<" * 4096)])
            await until(lambda: board.clients == 0, "the page that reads nothing to be dropped")
        finally:
            sock.close()


async def test_the_cookie_is_a_session_id_and_logging_out_asks_for_the_key_again(bus: Bus) -> None:
    async with serving(bus, api_keys=[hash_key("s3cret")]) as board, \
            aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        async with http.post(board.url + "login", data={"key": "s3cret"}, allow_redirects=False) as r:
            assert r.status == 303
            cookies = r.headers.getall("Set-Cookie")
        # Neither the key nor its digest leaves the server; a random id does.
        assert not any("s3cret" in c or hash_key("s3cret") in c for c in cookies), cookies
        found = re.match(r"llmgw_session=([A-Za-z0-9_-]{43});", cookies[0])
        assert found, cookies
        sid = found.group(1)
        assert "HttpOnly" in cookies[0] and "SameSite=Strict" in cookies[0] and "Max-Age=" in cookies[0]

        async def page_with(cookie: str) -> tuple[int, str]:
            async with aiohttp.ClientSession() as bare, bare.get(board.url, headers={"Cookie": cookie}) as r:
                return r.status, await r.text()

        # The raw key in a cookie (what the dashboard used to set), a made-up id: the key form again.
        for cookie in ("llmgw_key=s3cret", "llmgw_session=s3cret", f"llmgw_session={secrets.token_urlsafe(32)}"):
            status, text = await page_with(cookie)
            assert status == 401 and 'name="key"' in text, cookie
        # And a browser that still holds the key from before is told to forget it.
        async with aiohttp.ClientSession() as bare, \
                bare.get(board.url, headers={"Cookie": "llmgw_key=s3cret"}) as r:
            assert any(c.startswith('llmgw_key="";') and "Max-Age=0" in c for c in r.headers.getall("Set-Cookie"))
        # The session: the page, with a way out, and a live stream.
        status, text = await page_with(f"llmgw_session={sid}")
        assert status == 200 and 'action="logout"' in text
        stream = await http.get(board.url + "events")
        try:
            assert stream.status == 200
            async with http.post(board.url + "logout", allow_redirects=False) as r:
                assert r.status == 303 and r.headers["Location"] == "./"
                assert any(c.startswith('llmgw_session="";') and "Max-Age=0" in c
                           for c in r.headers.getall("Set-Cookie"))
            # The open stream is told, so the page asks for the key, and ends.
            async with asyncio.timeout(10):
                told = [line async for line in stream.content]
            assert b"event: logout\n" in told
        finally:
            stream.close()
        async with http.get(board.url) as r:
            assert r.status == 401 and 'name="key"' in await r.text()
        status, text = await page_with(f"llmgw_session={sid}")  # the old id, sent again
        assert status == 401 and 'name="key"' in text


def test_sessions_expire_and_the_table_is_bounded() -> None:
    s = Sessions(size=2, ttl_s=10)
    a, b = s.open(now=0), s.open(now=1)
    assert a != b and len(a) == 43 and s.valid(a, now=5) and s.valid(b, now=5)
    c = s.open(now=2)  # a third: the oldest goes
    assert not s.valid(a, now=3) and s.valid(b, now=3) and s.valid(c, now=3) and len(s) == 2
    assert not s.valid(b, now=11) and s.valid(c, now=11.9) and not s.valid(c, now=12)
    d = s.open(now=20)
    s.close(d)
    assert not s.valid(d, now=20) and not s.valid("", now=20) and len(s) == 0


@pytest.mark.parametrize(("remote", "client"), [
    ("127.0.0.2", "127.0.0.2"),
    ("::ffff:10.1.2.3", "10.1.2.3"),  # an IPv4 client of a dual-stack listener
    ("2001:db8:1:2:a::1", "2001:db8:1:2::/64"),  # one IPv6 host holds a whole /64
    ("2001:db8:1:2:b::9", "2001:db8:1:2::/64"),
    (None, "unknown"),
])
def test_a_client_is_its_address_or_its_ipv6_network(remote: str | None, client: str) -> None:
    assert client_of(remote) == client


async def test_one_address_cannot_hold_every_socket(bus: Bus) -> None:
    """Sockets that never ask for a page count too: past connections_per_client from one address a new
    one is closed at once; the socket it was refused for, freed, is served again, and others are served."""
    limits = Limits(connections_per_client=4, idle_s=30.0)
    async with serving(bus, limits=limits) as board, from_address(OTHER) as other:
        host, port = where(board.url)
        held: list[asyncio.StreamWriter] = []
        try:
            for _ in range(limits.connections_per_client):
                _, writer = await asyncio.open_connection(host, port, local_addr=(HOG, 0))
                held.append(writer)
            await until(lambda: board.sockets.open[HOG] == limits.connections_per_client, "the sockets counted")
            reader, writer = await asyncio.open_connection(host, port, local_addr=(HOG, 0))
            held.append(writer)
            async with asyncio.timeout(5):  # closed long before idle_s
                assert await reader.read() == b""
            assert board.sockets.refused == 1 and board.sockets.open[HOG] == limits.connections_per_client
            async with other.get(board.url + "static/dashboard.css") as r:
                assert r.status == 200
            held[0].close()
            await until(lambda: board.sockets.open[HOG] == limits.connections_per_client - 1, "a socket freed")
            async with from_address(HOG) as hog, hog.get(board.url + "static/dashboard.css") as r:
                assert r.status == 200
        finally:
            for writer in held:
                writer.close()
    assert not board.sockets.open  # every socket counted out again
