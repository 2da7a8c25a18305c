"""The router's front (llmgw/router/routes.py): what aiohttp's Application did for it, done by one handler.

HEAD on the GET routes, ``Expect: 100-continue`` before a body, a model name with a slash, and
``x-request-id`` on every answer, whichever handler or refusal made it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
from running import engines as running_engines
from test_router import in_pool, place

from llmgw.bus import Bus
from llmgw.engine.fake import EngineProcess
from llmgw.router.server import Router

MODEL = "front-model"
SLASHED = "org/front-model"
BODY = b'{"model": "front-model", "messages": [{"role": "user", "content": "hi"}]}'


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, EngineProcess]]:
    with running_engines(F=(MODEL, "--chunks", "2"), S=(SLASHED,)) as procs:
        yield procs


@pytest.fixture
async def router(bus: Bus, engines: dict[str, EngineProcess]) -> AsyncIterator[Router]:
    r = Router(bus, "router-front", tick_s=3600)
    await r.start("127.0.0.1", 0)
    await place(bus, "F", MODEL, engines["F"].url)
    await place(bus, "S", SLASHED, engines["S"].url)
    await r.sink.wait_for(in_pool("F", "S"))
    try:
        yield r
    finally:
        await r.stop()


async def test_get_routes_answer_head_with_no_body_and_their_id(router: Router) -> None:
    async with aiohttp.ClientSession() as s:
        for path in ("/health", "/v1/models", "/metrics", f"/v1/models/{MODEL}"):
            async with s.head(router.url + path) as resp:
                assert resp.status == 200, path
                assert len(resp.headers["x-request-id"]) == 32
                assert await resp.read() == b""
        async with s.head(router.url + "/v1/chat/completions") as resp:  # a POST route: not a GET one
            assert (resp.status, resp.headers["Allow"]) == (405, "POST")


async def test_a_model_name_with_a_slash_is_found_encoded_or_not(router: Router) -> None:
    async with aiohttp.ClientSession() as s:
        for path in ("/v1/models/org/front-model", "/v1/models/org%2Ffront-model"):
            async with s.get(router.url + path) as resp:
                assert resp.status == 200, path
                assert (await resp.json())["id"] == SLASHED
        async with s.get(router.url + "/v1/models/") as resp:  # no name: the models' path, not a model
            assert resp.status == 405


async def test_expect_100_continue_gets_its_interim_answer_then_the_reply(router: Router) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(router.url + "/v1/chat/completions", data=BODY, expect100=True,
                          headers={"Content-Type": "application/json", "x-request-id": "front-1"}) as resp:
            assert resp.status == 200
            assert resp.headers["x-request-id"] == "front-1"
            assert (await resp.json())["choices"][0]["message"]["content"] == "hello from F"


async def test_an_expectation_the_router_cannot_meet_is_a_417_it_can_trace(router: Router) -> None:
    reader, writer = await asyncio.open_connection(*router.url.removeprefix("http://").split(":"))
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 200-ok\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY)
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode()
    finally:
        writer.close()
    assert head.startswith("HTTP/1.1 417 ")
    assert "x-request-id: " in head.lower()
    assert "application/json" in head


async def test_every_answer_carries_its_id_streams_and_refusals_too(router: Router) -> None:
    async with aiohttp.ClientSession() as s:
        stream = BODY[:-1] + b', "stream": true}'
        async with s.post(router.url + "/v1/chat/completions", data=stream,
                          headers={"x-request-id": "front-stream"}) as resp:
            assert resp.status == 200 and resp.headers["x-request-id"] == "front-stream"
            assert b"[DONE]" in await resp.read()
        for method, path, status in (("GET", "/nowhere", 404), ("GET", "/v1/completions", 405),
                                     ("POST", "/v1/completions", 400)):
            async with s.request(method, router.url + path, data=b"{}",
                                 headers={"x-request-id": f"front-{status}"}) as resp:
                assert resp.status == status
                assert resp.headers["x-request-id"] == f"front-{status}"
                assert (await resp.json())["error"]["request_id"] == f"front-{status}"  # and in its error
