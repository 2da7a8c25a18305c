"""The router's way to its engines: HTTP/1.1 over kept-alive connections, answers parsed by llhttp.

Why not aiohttp's client, which the rest of llmgw uses to talk to engines: on the router's hot
path it was the largest single cost. A pass-through proxy on aiohttp's server spends about 45 %
of its CPU a request in aiohttp's client (URL and header maps, cookie and auto-header handling,
a stream reader, timer handles a read; docs/benchmarks.md, issue 46), and the router proxies
every request. This client does what a proxy to engines needs, and nothing else:

* one POST at a time per connection (no pipelining); connections kept alive per engine
  (``host:port``) and reused newest first, dropped when the engine closes them or after
  ``KEEPALIVE_S`` idle, or when an answer said ``Connection: close``, was not read to its end, or
  had bytes after it;
* the answer's head and framing (Content-Length, chunked, or until close) parsed by llhttp
  (``httptools``, the parser of uvicorn), its body handed over as it arrives, undecoded (the
  router passes bytes on as the engine wrote them); 1xx interim answers skipped;
* every wait bounded: connecting by ``connect_s``, and the answer by ``read_s`` between any two
  of its reads (headers, each chunk), as aiohttp's ``sock_read``: one timer a request, which
  data arriving only moves, not re-creates. Past ``MAX_BUFFERED`` bytes not yet taken by
  ``readany`` the engine's socket is paused (a slow client slows its engine, not the router's
  memory), and its silence then is not counted against it;
* an engine's head bounded (``MAX_HEAD_BYTES``); a header value with CR or LF is refused before
  anything is sent (no header of a request can be split into two).

Its errors say which side of the exchange broke: ``EngineUnreachable`` before any byte of an
answer (refused, timed out connecting, or a kept-alive connection the engine had just closed:
another replica may take the request), ``EngineBrokeOff`` once the answer began (not HTTP, cut
short), and ``TimeoutError`` for an engine silent past ``read_s``.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from typing import cast

import httptools
from yarl import URL

USER_AGENT = "llmgw"
KEEPALIVE_S = 30.0  # an idle connection older than this is closed, not reused
MAX_IDLE = 1024  # idle connections kept per engine; more are closed
MAX_BUFFERED = 256 * 1024  # answer bytes waiting for ``readany`` before the engine's socket is paused
MAX_HEAD_BYTES = 64 * 1024  # an engine's status line and headers


class EngineUnreachable(Exception):  # noqa: N818 - named for what it says, as aiohttp's ServerDisconnectedError
    """No byte of an answer came: the engine refused the connection, did not accept it in time, or
    closed a kept-alive one as the request went out. Nothing was answered, so another replica may try."""


class EngineBrokeOff(Exception):  # noqa: N818
    """The engine's answer began and did not end as its framing said, or was not HTTP/1.1."""


class _Trailing(Exception):  # noqa: N818 - stops llhttp at bytes after the answer
    pass


class _HeadTooBig(Exception):  # noqa: N818 - stops llhttp at a head past MAX_HEAD_BYTES
    pass


class _Endpoint:
    """One engine's address, parsed once: where to connect, what ``Host`` says, and its idle connections."""

    __slots__ = ("host", "idle", "port", "prefix", "start")

    def __init__(self, endpoint: str) -> None:
        url = URL(endpoint)
        if url.scheme != "http" or not url.host:
            raise ValueError(f"engine endpoint {endpoint!r} is not an http:// URL with a host")
        self.host = url.host
        self.port = url.port or 80
        self.prefix = url.raw_path.rstrip("/")  # an engine behind a path ("http://host:port/engine")
        host = f"[{url.host}]" if ":" in url.host else url.host
        self.start = f"Host: {host}:{self.port}\r\nUser-Agent: {USER_AGENT}\r\nAccept-Encoding: identity\r\n"
        self.idle: deque[_Conn] = deque()


class _Conn(asyncio.Protocol):
    """One connection to an engine and the answer it is reading (``answer``), if any."""

    def __init__(self, loop: asyncio.AbstractEventLoop, where: _Endpoint, read_s: float,
                 live: set[_Conn]) -> None:
        self.loop = loop
        self.where = where
        self.read_s = read_s
        self.live = live
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: Answer | None = None
        self.closed = False
        self.reusable = True
        self.paused = False
        self.idle_since = 0.0
        self.last = 0.0  # when the engine last sent anything (loop time), for the read timeout
        self.timer: asyncio.TimerHandle | None = None
        self.head_bytes = 0  # of the answer's headers, as llhttp gives them
        self.pending = 0  # bytes fed while its head had not ended
        self.framed = False  # Content-Length or chunked: an end other than the connection's
        self.got = False  # any byte of the answer arrived

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one, unregistered as such
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.live.add(self)

    def data_received(self, data: bytes) -> None:
        a = self.answer
        if a is None or a.done:  # bytes nobody asked for: this connection's framing can't be trusted
            self.reusable = False
            self.close()
            return
        self.got = True
        self.last = self.loop.time()
        heading = not a.headed
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            if isinstance(e.__context__, _HeadTooBig):
                self._fail(EngineBrokeOff(f"the engine's answer head is over {MAX_HEAD_BYTES} bytes"))
            elif isinstance(e.__context__, _Trailing):
                self.close()
            else:
                raise
        except httptools.HttpParserUpgrade:
            self._fail(EngineBrokeOff("the engine switched protocols"))
        except httptools.HttpParserError as e:
            self._fail(EngineBrokeOff(f"the engine's answer is not HTTP/1.1 ({e})"))
        else:
            if heading and not a.headed:  # llhttp holds a head's bytes until it ends: bounded here too
                self.pending += len(data)
                if self.pending > MAX_HEAD_BYTES:
                    self._fail(EngineBrokeOff(f"the engine's answer head is over {MAX_HEAD_BYTES} bytes"))

    def eof_received(self) -> bool:
        return False  # close the transport: a half-closed engine is done with this connection

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.live.discard(self)
        self._unarm()
        a = self.answer
        if a is None:
            try:
                self.where.idle.remove(self)
            except ValueError:
                pass
            return
        if a.done:
            return
        if a.headed and not self.framed and exc is None:
            a._complete()  # an answer without a length ends with its connection
        elif not self.got:
            a._fail(EngineUnreachable("the engine closed the connection before answering"
                                      + (f" ({exc})" if exc else "")))
        else:
            a._fail(EngineBrokeOff("the engine closed the connection before its answer ended"
                                   + (f" ({exc})" if exc else "")))

    def pause_writing(self) -> None:  # a large body on its way; the transport buffers it
        pass

    def resume_writing(self) -> None:
        pass

    # --- llhttp's callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        a = self.answer
        if a is None or a.done:  # a second answer to one request: parse no further, reuse never
            raise _Trailing

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes > MAX_HEAD_BYTES:
            raise _HeadTooBig
        n = name.lower()
        a = self.answer
        if a is None:
            return
        if n == b"content-type":
            a.content_type = value.decode("latin-1")
        elif n == b"content-length" or (n == b"transfer-encoding" and b"chunked" in value.lower()):
            self.framed = True

    def on_headers_complete(self) -> None:
        a = self.answer
        if a is None:
            return
        status = self.parser.get_status_code()
        if status < 200:  # 100 Continue and the like: the answer is the next message
            a.content_type = ""
            self.framed = False
            return
        a.status = status
        a.headed = True
        a._wake()

    def on_body(self, body: bytes) -> None:
        a = self.answer
        if a is None or a.status < 200:
            return
        a.chunks.append(body)
        a.size += len(body)
        if a.size > MAX_BUFFERED and not a.whole and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        a._wake()

    def on_message_complete(self) -> None:
        a = self.answer
        if a is None or a.status < 200:
            return
        if not self.parser.should_keep_alive():
            self.reusable = False
        a._complete()

    # --- the connection's side of an answer --------------------------------------------

    def arm(self) -> None:
        self.last = self.loop.time()
        self.timer = self.loop.call_at(self.last + self.read_s, self._check)

    def _unarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _check(self) -> None:
        """The read timeout: fires once a request, and again only if the engine spoke since."""
        self.timer = None
        a = self.answer
        if a is None or a.done:
            return
        now = self.loop.time()
        if self.paused:  # the client is the slow one: the engine's silence is ours
            self.last = now
        if now - self.last >= self.read_s - 0.001:  # (a timer may fire a clock tick early)
            self._fail(TimeoutError(f"the engine sent nothing for {self.read_s:g}s"))
            return
        self.timer = self.loop.call_at(self.last + self.read_s, self._check)

    def taken(self, a: Answer) -> None:
        """``a``'s bytes were read (or all of them will be, ``whole``): the engine may send more."""
        if self.paused and (a.whole or a.size <= MAX_BUFFERED) and self.transport is not None and not self.closed:
            self.paused = False
            self.last = self.loop.time()
            self.transport.resume_reading()

    def _fail(self, error: BaseException) -> None:
        a = self.answer
        if a is not None and not a.done:
            a._fail(error)
        self.close()

    def close(self) -> None:
        self.reusable = False
        self._unarm()
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()

    def done_with(self, a: Answer) -> None:
        """``a`` was released: this connection back to its engine's idle ones, or closed."""
        self._unarm()
        if not (a.done and self.reusable and not self.closed) or a.error is not None:
            self.close()
            return
        self.answer = None
        self.got = False
        self.framed = False
        self.head_bytes = self.pending = 0
        idle = self.where.idle
        if len(idle) >= MAX_IDLE:
            self.close()
            return
        self.idle_since = self.loop.time()
        idle.append(self)


class Answer:
    """An engine's answer: ``status`` and ``content_type`` once its head came; its body by ``read`` or
    ``readany``. ``release`` (always, at the end) gives the connection back or closes it."""

    __slots__ = ("chunks", "content_type", "done", "error", "headed", "size", "status", "waiter", "whole", "_conn")

    def __init__(self, conn: _Conn) -> None:
        self._conn: _Conn | None = conn
        self.status = 0
        self.content_type = ""
        self.headed = False
        self.done = False
        self.whole = False  # ``read`` waits for the end: never paused for want of a reader
        self.error: BaseException | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.waiter: asyncio.Future[None] | None = None

    def _wake(self) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    def _complete(self) -> None:
        self.done = True
        conn = self._conn
        if conn is not None:
            conn._unarm()
        self._wake()

    def _fail(self, error: BaseException) -> None:
        self.error = error
        self.done = True
        self._wake()

    async def _wait(self) -> None:
        conn = self._conn
        assert conn is not None, "the answer was released"
        self.waiter = conn.loop.create_future()
        await self.waiter

    async def readany(self) -> bytes:
        """What arrived since the last call (waiting for something), or b"" at the answer's end."""
        while not self.chunks:
            if self.error is not None:
                raise self.error
            if self.done:
                return b""
            await self._wait()
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks = []
        self.size = 0
        if self._conn is not None:
            self._conn.taken(self)
        return data

    async def read(self) -> bytes:
        """The whole body (the answer's end waited for)."""
        self.whole = True
        if self._conn is not None:
            self._conn.taken(self)
        while not self.done:
            await self._wait()
        if self.error is not None:
            raise self.error
        data = b"".join(self.chunks)
        self.chunks = []
        self.size = 0
        return data

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.done_with(self)

    def close(self) -> None:
        """Never reuse this connection (an answer cut short by the router's side)."""
        if self._conn is not None:
            self._conn.reusable = False
        self.release()


class Client:
    """Kept-alive connections to engines, one POST at a time each."""

    def __init__(self, connect_s: float, read_s: float) -> None:
        self.connect_s = connect_s
        self.read_s = read_s
        self._where: dict[str, _Endpoint] = {}
        self._live: set[_Conn] = set()

    def _endpoint(self, endpoint: str) -> _Endpoint:
        where = self._where.get(endpoint)
        if where is None:
            if len(self._where) > 10_000:  # endpoints come and go; never grow without bound
                self.close_idle()
                self._where.clear()
            try:
                where = _Endpoint(endpoint)
            except ValueError as e:  # an endpoint no agent of ours publishes: this replica cannot be reached
                raise EngineUnreachable(str(e)) from e
            self._where[endpoint] = where
        return where

    async def _connect(self, where: _Endpoint) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_s):
                _, conn = await loop.create_connection(
                    lambda: _Conn(loop, where, self.read_s, self._live), where.host, where.port)
        except TimeoutError as e:
            raise EngineUnreachable(f"{where.host}:{where.port} did not accept a connection within "
                                    f"{self.connect_s:g}s") from e
        except OSError as e:
            raise EngineUnreachable(f"{where.host}:{where.port}: {e.strerror or e}") from e
        return conn

    async def post(self, endpoint: str, path: str, body: bytes, headers: dict[str, str]) -> Answer:
        """POST ``body`` to ``endpoint + path``; the answer once its head came."""
        where = self._endpoint(endpoint)
        lines = [f"POST {where.prefix}{path} HTTP/1.1\r\n{where.start}Content-Length: {len(body)}\r\n"]
        for name, value in headers.items():
            if "\n" in value or "\r" in value or "\n" in name or "\r" in name or ":" in name:
                raise ValueError(f"header {name[:64]!r} would split the request's head")
            lines.append(f"{name}: {value}\r\n")
        lines.append("\r\n")
        head = "".join(lines).encode("latin-1")
        idle = where.idle
        conn: _Conn | None = None
        now = asyncio.get_running_loop().time()
        while idle:
            c = idle.pop()
            if not c.closed and now - c.idle_since < KEEPALIVE_S:
                conn = c
                break
            c.close()
        if conn is None:
            conn = await self._connect(where)
        answer = conn.answer = Answer(conn)
        transport = conn.transport
        assert transport is not None
        try:
            if len(body) <= 16 * 1024:
                transport.write(head + body)
            else:
                transport.writelines((head, body))
            conn.arm()
            while not answer.headed:
                if answer.error is not None:
                    raise answer.error
                await answer._wait()
        except BaseException:
            answer.close()  # cancelled, or no answer: this connection is in no state to reuse
            raise
        return answer

    def close_idle(self) -> None:
        for where in self._where.values():
            while where.idle:
                where.idle.pop().close()

    async def close(self) -> None:
        """Every connection closed, in use or idle."""
        self.close_idle()
        for conn in list(self._live):
            conn.close()
        await asyncio.sleep(0)  # the transports' close callbacks run
