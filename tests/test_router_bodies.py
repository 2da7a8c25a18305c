"""Request bodies the router cannot read, or will not take: an OpenAI-style 4xx, one log line, nothing forwarded.

Each request goes to a router started against the session's nats-server, in front of a fake
engine process; the malformed ones are written on a raw socket, the way a hostile client sends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import io
import json
import logging
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlsplit

import aiohttp
import pytest
from click.testing import CliRunner
from running import engines as running_engines
from running import until
from test_router import in_pool, place

from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.engine.fake import EngineProcess
from llmgw.errors import ConfigError
from llmgw.router.server import Router

MODEL = "body-model"
MiB = 1024 * 1024
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, EngineProcess]]:
    with running_engines(E=(MODEL,)) as procs:
        yield procs


async def started(bus: Bus, engines: dict[str, EngineProcess], **kwargs: object) -> Router:
    r = Router(bus, "router-bodies", tick_s=3600, **kwargs)  # type: ignore[arg-type]
    await r.start("127.0.0.1", 0)
    await place(bus, "E", MODEL, engines["E"].url)
    await r.sink.wait_for(in_pool("E"))
    return r


@pytest.fixture
async def router(bus: Bus, engines: dict[str, EngineProcess]) -> AsyncIterator[Router]:
    """A router with the default body limit."""
    r = await started(bus, engines)
    try:
        yield r
    finally:
        await r.stop()


def chat(pad: int = 0) -> bytes:
    """A chat request, padded with spaces (still valid JSON) to ``pad`` bytes when given."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    return body[:-1] + b" " * (pad - len(body)) + b"}" if pad else body


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body of one answer (bounded: the router must answer by itself)."""
    async with asyncio.timeout(10):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(lines[0].split()[1]), headers, body


async def raw(router: Router, data: bytes, then: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes on a fresh connection (``then`` a moment later); what the router answers."""
    u = urlsplit(router.url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    try:
        writer.write(data)
        await writer.drain()
        if then:
            await asyncio.sleep(0.2)  # the handler is reading the body by now
            writer.write(then)
            await writer.drain()
        return await answer(reader)
    finally:
        writer.close()
        with contextlib.suppress(OSError):  # the router may have closed it first
            await writer.wait_closed()


def openai_error(body: bytes) -> dict[str, object]:
    """The router's error document: {"error": {"message", "type", "param", "code"}}."""
    doc = json.loads(body)
    assert set(doc) == {"error"} and {"message", "type", "param", "code"} <= set(doc["error"]), doc
    err: dict[str, object] = doc["error"]
    return err


async def engine_requests(engine: EngineProcess) -> int:
    async with aiohttp.ClientSession() as s, s.get(engine.url + "/stats") as resp:
        n: int = (await resp.json())["requests"]
        return n


def logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """What a client's requests put in the log: every record at WARNING or above."""
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


async def answers_normally(router: Router) -> None:
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, data=chat()) as resp:
        assert resp.status == 200, await resp.text()


POST = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()


async def test_a_body_that_is_not_the_gzip_it_claims_is_a_400_and_one_log_line(
        router: Router, engines: dict[str, EngineProcess], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    before = await engine_requests(engines["E"])
    body = chat()
    for _ in range(3):
        status, headers, got = await raw(router, POST + b"Content-Encoding: gzip\r\n"
                                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert status == 400
        assert headers["content-type"].startswith("application/json")
        err = openai_error(got)
        assert err["type"] == "invalid_request_error" and err["code"] == "malformed_request"
        assert "gzip" in str(err["message"])
    records = logged(caplog)
    assert [(r.name, r.levelname) for r in records] == [("llmgw.router.server", "WARNING")] * 3
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert all("\n" not in r.getMessage() and "gzip" in r.getMessage() for r in records)
    assert await engine_requests(engines["E"]) == before
    # A body that is the gzip it claims still reaches the engine, decompressed.
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, data=gzip.compress(body),
                                                    headers={"Content-Encoding": "gzip"}) as resp:
        assert resp.status == 200 and (await resp.json())["system_fingerprint"] == "E"
    assert router.metrics.errors("", "bad_request") == 3


async def test_a_malformed_chunked_body_is_a_400_and_one_log_line(
        router: Router, engines: dict[str, EngineProcess], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    before = await engine_requests(engines["E"])
    bad = [b"zz\r\n{}\r\n0\r\n\r\n",              # a chunk size that is not hex
           b"5\r\n{\"model\r\nxx\r\n0\r\n\r\n"]    # a chunk that does not end where its size says
    for chunks in bad * 2:
        status, headers, got = await raw(router, POST + b"Transfer-Encoding: chunked\r\n\r\n" + chunks)
        assert status == 400, got
        assert headers["content-type"].startswith("application/json")
        err = openai_error(got)
        assert err["type"] == "invalid_request_error" and err["code"] == "malformed_request"
    records = logged(caplog)
    assert [(r.name, r.levelname) for r in records] == [("llmgw.router.server", "WARNING")] * 4
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert all("\n" not in r.getMessage() for r in records)
    assert await engine_requests(engines["E"]) == before
    await answers_normally(router)


async def test_a_chunk_that_breaks_after_the_body_began_is_answered_without_a_traceback(
        bus: Bus, engines: dict[str, EngineProcess], caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp's C parser drops such a body without failing it: the router sees a body that stalls."""
    caplog.set_level(logging.DEBUG)
    r = await started(bus, engines, body_timeout_s=0.5)
    try:
        before = await engine_requests(engines["E"])
        status, headers, body = await raw(r, POST + b"Transfer-Encoding: chunked\r\n\r\n3\r\n{\"m\r\n",
                                          then=b"zz\r\n{}\r\n0\r\n\r\n")
        assert status in (400, 408), body  # 408 after --body-timeout while aiohttp drops it unfailed
        assert headers["connection"] == "close"
        assert openai_error(body)["type"] == "invalid_request_error"
        assert not [x for x in caplog.records if x.exc_info or x.levelno >= logging.ERROR]
        assert await engine_requests(engines["E"]) == before
        await answers_normally(r)
    finally:
        await r.stop()


async def test_a_gzip_body_that_inflates_past_the_limit_is_refused_while_it_is_read(
        bus: Bus, engines: dict[str, EngineProcess]) -> None:
    r = await started(bus, engines, max_body_bytes=64 * 1024)
    try:
        before = await engine_requests(engines["E"])
        bomb = gzip.compress(chat(8 * MiB))  # a few KiB on the wire: Content-Length is no guide
        async with aiohttp.ClientSession() as s, s.post(r.url + CHAT, data=bomb,
                                                        headers={"Content-Encoding": "gzip"}) as resp:
            assert resp.status == 413
            assert openai_error(await resp.read())["code"] == "request_too_large"
        assert await engine_requests(engines["E"]) == before
    finally:
        await r.stop()


# aiohttp warns for every bytes body over 1 MiB it sends; the router forwards bodies as bytes (upstream.py).
@pytest.mark.filterwarnings("ignore:Sending a large body directly with raw bytes:ResourceWarning")
async def test_the_default_limit_is_the_routers_own_and_an_engines_smaller_one_is_said_its_way(
        router: Router, engines: dict[str, EngineProcess]) -> None:
    assert router.max_body_bytes == 32 * MiB
    # The fake engine, like aiohttp's default, takes 1 MiB; vLLM takes more. A body between the
    # two reaches it, and its plain-text 413 must still reach the client as an OpenAI error.
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, data=io.BytesIO(chat(2 * MiB))) as resp:
        assert resp.status == 413
        err = openai_error(await resp.read())
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert "32 MiB" in str(err["message"]) and "--max-body" in str(err["message"])


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_the_limit_is_enforced_before_forwarding_and_a_body_at_it_still_works(
        bus: Bus, engines: dict[str, EngineProcess], chunked: bool) -> None:
    limit = 512 * 1024  # below the fake engine's own 1 MiB, so any 413 here is the router's
    r = await started(bus, engines, max_body_bytes=limit)

    async def post(body: bytes) -> tuple[int, bytes]:
        async def pieces() -> AsyncIterator[bytes]:  # no Content-Length: Transfer-Encoding: chunked
            for i in range(0, len(body), 64 * 1024):
                yield body[i:i + 64 * 1024]

        async with aiohttp.ClientSession() as s, s.post(r.url + CHAT, data=pieces() if chunked else body) as resp:
            return resp.status, await resp.read()

    try:
        before = await engine_requests(engines["E"])
        status, got = await post(chat(limit))  # exactly at the limit
        assert status == 200, got
        assert await engine_requests(engines["E"]) == before + 1
        status, got = await post(chat(limit - 1))
        assert status == 200, got
        status, got = await post(chat(limit + 1))
        assert status == 413
        err = openai_error(got)
        assert err["code"] == "request_too_large"
        assert "524288 bytes (512 KiB)" in str(err["message"]) and "--max-body" in str(err["message"])
        assert await engine_requests(engines["E"]) == before + 2  # the one over the limit was not forwarded
        assert r.metrics.errors("", "too_large") == 1
        await answers_normally(r)
    finally:
        await r.stop()


def test_cli_max_body_takes_a_size_and_refuses_nonsense() -> None:
    runner = CliRunner()
    res = runner.invoke(cli, ["router", "--help"], terminal_width=200)
    assert res.exit_code == 0 and "--max-body SIZE" in res.output and "32MiB" in res.output
    for bad in ("lots", "0", "-1MiB", "1.5XB"):
        res = runner.invoke(cli, ["router", "--max-body", bad, "--nats-url", "nats://127.0.0.1:1"])
        assert res.exit_code == 2, (bad, res.output)
        assert "--max-body" in res.output and "e.g. 32MiB" in res.output, res.output
    res = runner.invoke(cli, ["router", "--max-body", "1MiB", "--max-body-mb", "1", "--nats-url", "nats://127.0.0.1:1"])
    assert res.exit_code == 2 and "not both" in res.output  # the older spelling still parses, alone


def test_a_router_limit_that_is_not_positive_is_refused(bus: Bus) -> None:
    with pytest.raises(ConfigError, match="--max-body must be positive"):
        Router(bus, "r", max_body_bytes=0)


async def test_one_address_cannot_hold_every_socket_when_capped(bus: Bus, engines: dict[str, EngineProcess]) -> None:
    """--max-connections-per-client 2: a third socket from one address is closed before a byte is read;
    another address is served, and a freed socket is served again. 0 (the default) caps nothing."""
    r = await started(bus, engines, max_connections_per_client=2)
    held: list[asyncio.StreamWriter] = []
    try:
        parts = urlsplit(r.url)
        host, port = parts.hostname or "", parts.port or 0
        for _ in range(2):
            _, writer = await asyncio.open_connection(host, port, local_addr=("127.0.0.2", 0))
            held.append(writer)
        await until(lambda: r.sockets.open["127.0.0.2"] == 2, "two sockets counted")
        reader, writer = await asyncio.open_connection(host, port, local_addr=("127.0.0.2", 0))
        held.append(writer)
        async with asyncio.timeout(5):  # long before the 30 s header timeout
            assert await reader.read() == b""
        assert r.sockets.refused == 1
        status, _, _ = await raw(r, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # from 127.0.0.1
        assert status == 200
        held[0].close()
        await until(lambda: r.sockets.open["127.0.0.2"] == 1, "a socket freed")
        reader, writer = await asyncio.open_connection(host, port, local_addr=("127.0.0.2", 0))
        held.append(writer)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        async with asyncio.timeout(5):
            assert (await reader.read()).startswith(b"HTTP/1.1 200")
    finally:
        for w in held:
            w.close()
        await r.stop()
    with pytest.raises(ConfigError, match="--max-connections-per-client must be 0"):
        Router(bus, "bad", max_connections_per_client=-1)
