"""The router's HTTP/1.1 client to engines (llmgw/engine/http1.py), against engines that misbehave.

Each engine here is a few lines of asyncio speaking raw bytes, so that every framing, every
break and every silence is the test's own. Every test runs on asyncio's loop and on uvloop's,
which is the one the router's process runs on (their transports differ).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
import uvloop

from llmgw.engine import http1
from llmgw.engine.http1 import Client, EngineBrokeOff, EngineUnreachable

Handler = Callable[["Engine", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
JSON = b'{"ok":true}'


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, None]], None]:
    def runner(coro: Coroutine[Any, Any, None]) -> None:
        with asyncio.Runner(loop_factory=LOOPS[request.param]) as r:
            r.run(asyncio.wait_for(coro, 30))
    return runner


class Engine:
    """A scripted engine: ``handler`` answers each connection; what came is counted."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.heads: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Engine:
        async def on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(self, reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()
        self.server = await asyncio.start_server(on, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def request(self, reader: asyncio.StreamReader) -> bytes:
        """One request read whole (head and Content-Length body); its head kept."""
        head = await reader.readuntil(b"\r\n\r\n")
        self.heads.append(head)
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        return await reader.readexactly(length)


def answer(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body), b"".join(h + b"\r\n" for h in extra), body)


def keep_answering(*extra: bytes) -> Handler:
    async def handler(e: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            body = await e.request(reader)
            writer.write(answer(b'{"echo":%d}' % len(body), *extra))
    return handler


async def post(c: Client, url: str, body: bytes = b'{"model":"m"}', **headers: str) -> http1.Answer:
    return await c.post(url, "/v1/chat/completions", body, {"Content-Type": "application/json", **headers})


async def bodies(e: Engine, n: int) -> list[bytes]:
    """``n`` requests to ``e`` one after the other, each answer read whole and released."""
    c = Client(connect_s=2, read_s=5)
    got = []
    for _ in range(n):
        a = await post(c, e.url)
        got.append(await a.read())
        a.release()
    await c.close()
    return got


def test_answers_come_back_whole_and_their_connection_is_reused(run: Any) -> None:
    async def go() -> None:
        async with Engine(keep_answering()) as e:
            c = Client(connect_s=2, read_s=5)
            for body in (b"{}", b'{"model":"x"}', b"[" + b"1," * 10_000 + b"1]"):  # the last one written apart
                a = await post(c, e.url, body)
                assert (a.status, a.content_type) == (200, "application/json")
                assert await a.read() == b'{"echo":%d}' % len(body)
                a.release()
            assert e.connections == 1
            head = e.heads[0].decode()
            assert head.startswith("POST /v1/chat/completions HTTP/1.1\r\n")
            assert f"Host: 127.0.0.1:{e.url.rsplit(':', 1)[1]}\r\n" in head
            assert "User-Agent: llmgw\r\n" in head and "Accept-Encoding: identity\r\n" in head
            await c.close()
    run(go())


def test_a_chunked_stream_is_read_as_it_comes(run: Any) -> None:
    events = [b"data: {\"i\":%d}\n\n" % i for i in range(5)] + [b"data: [DONE]\n\n"]
    go_on = asyncio.Event

    async def go() -> None:
        step = go_on()

        async def handler(e: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await e.request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                for ev in events:
                    writer.write(b"%x\r\n%s\r\n" % (len(ev), ev))
                    await writer.drain()
                    await step.wait()
                    step.clear()
                writer.write(b"0\r\n\r\n")

        async with Engine(handler) as e:
            c = Client(connect_s=2, read_s=5)
            for _ in range(2):
                a = await post(c, e.url)
                assert a.content_type == "text/event-stream"
                got = []
                for _ in events:
                    got.append(await a.readany())  # one event at a time: the engine waits for the test
                    step.set()
                assert got == events
                assert await a.readany() == b""
                a.release()
            assert e.connections == 1
            await c.close()
    run(go())


def test_an_answer_without_a_length_ends_with_its_connection_which_is_not_reused(run: Any) -> None:
    async def handler(e: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await e.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + JSON)
        await writer.drain()

    async def go() -> None:
        async with Engine(handler) as e:
            assert await bodies(e, 2) == [JSON, JSON]
            assert e.connections == 2
    run(go())


def test_connection_close_is_honoured(run: Any) -> None:
    async def go() -> None:
        async with Engine(keep_answering(b"Connection: close")) as e:
            assert await bodies(e, 3) == [b'{"echo":13}'] * 3
            assert e.connections == 3
    run(go())


def test_a_refused_connection_and_a_dropped_request_are_unreachable(run: Any) -> None:
    async def hang_up(e: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await e.request(reader)  # read, then closed without a byte of answer

    async def go() -> None:
        async with Engine(hang_up) as e:
            url = e.url
            c = Client(connect_s=2, read_s=5)
            with pytest.raises(EngineUnreachable, match="before answering"):
                await post(c, url)
        with pytest.raises(EngineUnreachable, match=url.rsplit(":", 1)[1]):  # nobody listens there now
            await post(c, url)
        await c.close()
    run(go())


def test_an_answer_cut_short_or_not_http_is_a_broken_one(run: Any) -> None:
    replies = [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + JSON,  # 11 of 100 bytes
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",  # no last chunk
        b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (http1.MAX_HEAD_BYTES + 1) + b"\r\n\r\n",
    ]

    async def handler(e: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await e.request(reader)
        writer.write(replies[e.connections - 1])
        await writer.drain()

    async def go() -> None:
        async with Engine(handler) as e:
            c = Client(connect_s=2, read_s=5)
            for why in ("before its answer ended", "before its answer ended", "not HTTP/1.1", "head is over"):
                with pytest.raises(EngineBrokeOff, match=why):
                    a = await post(c, e.url)
                    try:
                        await a.read()
                    finally:
                        a.release()
            await c.close()
    run(go())


def test_an_engine_silent_past_read_s_times_out_before_and_within_its_answer(run: Any) -> None:
    async def handler(e: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await e.request(reader)
        if e.connections == 2:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await asyncio.sleep(10)

    async def go() -> None:
        async with Engine(handler) as e:
            c = Client(connect_s=2, read_s=0.3)
            with pytest.raises(TimeoutError):
                await post(c, e.url)
            a = await post(c, e.url)
            assert await a.readany() == b"hello"
            with pytest.raises(TimeoutError):
                await a.readany()
            a.release()
            await c.close()
    run(go())


def test_an_interim_answer_is_skipped(run: Any) -> None:
    async def handler(e: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await e.request(reader)
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + answer(JSON))

    async def go() -> None:
        async with Engine(handler) as e:
            assert await bodies(e, 2) == [JSON, JSON]
            assert e.connections == 1
    run(go())


def test_bytes_after_an_answer_mean_its_connection_is_not_reused(run: Any) -> None:
    async def handler(e: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await e.request(reader)
            writer.write(answer(JSON) + answer(b'{"smuggled":1}'))

    async def go() -> None:
        async with Engine(handler) as e:
            assert await bodies(e, 2) == [JSON, JSON]  # never the second answer, on this request or the next
            assert e.connections == 2
    run(go())


def test_a_header_that_would_split_the_head_is_refused_before_anything_is_sent(run: Any) -> None:
    async def go() -> None:
        async with Engine(keep_answering()) as e:
            c = Client(connect_s=2, read_s=5)
            for bad in ({"X-Request-Id": "a\r\nX-Admin: 1"}, {"X-Evil\r\nX-Admin": "1"}, {"Authorization": "Bearer k\n"}):
                with pytest.raises(ValueError, match="split"):
                    await c.post(e.url, "/v1/completions", b"{}", bad)
            await asyncio.sleep(0.05)
            assert e.connections == 0
            await c.close()
    run(go())


def test_a_slow_reader_pauses_its_engine_and_is_not_timed_out_for_it(run: Any) -> None:
    piece = bytes(range(256)) * 256  # 64 KiB
    pieces = 64  # 4 MiB in all

    async def handler(e: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await e.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(pieces):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def go() -> None:
        async with Engine(handler) as e:
            c = Client(connect_s=2, read_s=0.3)
            a = await post(c, e.url)
            got, most = bytearray(), 0
            await asyncio.sleep(0.6)  # longer than read_s, with the engine paused by a full buffer
            while data := await a.readany():
                most = max(most, len(data))
                got += data
                if len(got) < 1 << 20:
                    await asyncio.sleep(0.01)
            assert bytes(got) == piece * pieces
            # Held near the mark (plus what one read of the socket brings), never the whole answer.
            assert most < 2 * http1.MAX_BUFFERED + len(piece)
            a.release()
            await c.close()
    run(go())


def test_a_request_cancelled_waiting_closes_its_connection(run: Any) -> None:
    closed = asyncio.Event

    async def go() -> None:
        ended = closed()

        async def handler(e: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await e.request(reader)
            await reader.read()  # until the client closes
            ended.set()

        async with Engine(handler) as e:
            c = Client(connect_s=2, read_s=5)
            task = asyncio.ensure_future(post(c, e.url))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(ended.wait(), 5)
            await c.close()
    run(go())


def test_an_idle_connection_the_engine_closed_is_not_used_again(run: Any) -> None:
    async def handler(e: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await e.request(reader)
        writer.write(answer(JSON))  # kept alive, by what it says, and closed at once all the same
        await writer.drain()

    async def go() -> None:
        async with Engine(handler) as e:
            c = Client(connect_s=2, read_s=5)
            for _ in range(3):
                a = await post(c, e.url)
                assert await a.read() == JSON
                a.release()
                await asyncio.sleep(0.1)  # the engine's FIN arrives while the connection is idle
            assert e.connections == 3
            await c.close()
    run(go())


def test_an_endpoint_that_is_not_plain_http_is_unreachable(run: Any) -> None:
    """Agents publish http:// endpoints only; another is a replica the router cannot reach (502, tried elsewhere)."""
    async def go() -> None:
        c = Client(connect_s=2, read_s=5)
        for url in ("https://127.0.0.1:1", "ftp://x", "http://", "not a url"):
            with pytest.raises(EngineUnreachable, match="not an http"):
                await post(c, url)
    run(go())
