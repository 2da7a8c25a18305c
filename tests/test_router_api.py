"""The router as OpenAI clients and Prometheus see it: every route and every error through the
official ``openai`` client, and /metrics read back with ``prometheus_client``'s own parsers."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from running import engines as running_engines
from test_router import in_pool, place, sample, scrape

from llmgw.apikeys import hash_key
from llmgw.bus import Bus
from llmgw.engine.fake import EngineProcess
from llmgw.router.metrics import ERROR_KINDS, LATENCY_BUCKETS, Metrics
from llmgw.router.server import Router

MODEL = "api-model"
SLASHED = "org/slashed-model"  # a Hugging Face style name: the client percent-encodes the slash
KEY = "sk-api-test"
ROUTER_PAGE = Path(__file__).resolve().parent.parent / "docs" / "router.md"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, EngineProcess]]:
    with running_engines(E=(MODEL, "--chunks", "3"), S=(SLASHED,)) as procs:
        yield procs


@pytest.fixture
async def router(bus: Bus, engines: dict[str, EngineProcess]) -> AsyncIterator[Router]:
    r = Router(bus, "router-api", tick_s=3600, api_keys=[hash_key(KEY)], max_body_bytes=4096, body_timeout_s=0.3)
    await r.start("127.0.0.1", 0)
    await place(bus, "E", MODEL, engines["E"].url)
    await place(bus, "S", SLASHED, engines["S"].url)
    await r.sink.wait_for(in_pool("E", "S"))
    try:
        yield r
    finally:
        await r.stop()


@pytest.fixture
async def client(router: Router) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0, timeout=20) as c:
        yield c


async def test_every_route_through_the_openai_client(client: openai.AsyncOpenAI, router: Router) -> None:
    chat = await client.chat.completions.create(model=MODEL, messages=HI)
    assert chat.choices[0].message.content == "hello from E"
    assert chat.usage is not None and chat.usage.completion_tokens == 3

    # stream_options reaches the engine untouched; its usage chunk comes back before [DONE].
    stream = await client.chat.completions.create(model=MODEL, messages=HI, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert [c.choices[0].delta.content for c in chunks if c.choices] == ["tok0 ", "tok1 ", "tok2 ", ""]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    # The fake engine's tokenizer: four bytes a token of "<|user|>\nhi\n".
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (3, 3)

    text = await client.completions.create(model=MODEL, prompt="hi")
    assert text.choices[0].text == "hello from E"
    pieces = [c.choices[0].text async for c in await client.completions.create(model=MODEL, prompt="hi", stream=True)]
    # No stream_options: the router asked the engine for usage all the same, counted it, and took it out.
    assert pieces == ["tok0 ", "tok1 ", "tok2 ", ""]

    emb = await client.embeddings.create(model=MODEL, input=["a", "b"])
    assert [d.index for d in emb.data] == [0, 1]

    assert sorted(m.id for m in (await client.models.list()).data) == sorted([MODEL, SLASHED])
    one = await client.models.retrieve(MODEL)
    assert (one.id, one.object, one.owned_by) == (MODEL, "model", "llmgw")
    assert (await client.models.retrieve(SLASHED)).id == SLASHED
    assert (await client.chat.completions.create(model=SLASHED, messages=HI)).system_fingerprint == "S"

    got = await scrape(router.url)
    # Two streamed requests: two first tokens. Tokens from every answer, streamed or not: chat 3+3, the
    # streamed chat's usage chunk 3+3, completions 1+3, the streamed ones' 1+3 (asked by the router),
    # embeddings 2 (+0), the slashed chat 3+3.
    assert got[sample("llmgw_router_time_to_first_token_seconds_count", model=MODEL)] == 2
    assert got[sample("llmgw_router_prompt_tokens_total", model=MODEL)] == 3 + 3 + 1 + 1 + 2
    assert got[sample("llmgw_router_prompt_tokens_cached_total", model=MODEL)] == 0  # this engine caches nothing
    assert got[sample("llmgw_router_completion_tokens_total", model=MODEL)] == 3 + 3 + 3 + 3
    assert got[sample("llmgw_router_completion_tokens_total", model=SLASHED)] == 3
    assert got[sample("llmgw_router_request_seconds_count", model=MODEL, stream="true")] == 2
    assert got[sample("llmgw_router_requests_total", model=MODEL, route="/v1/embeddings", code="200")] == 1


class _TrickleClient(openai.DefaultAsyncHttpxClient):  # type: ignore[misc]
    """Sends the first bytes of each request body, then nothing for longer than the router waits."""

    async def send(self, request: Any, **kwargs: Any) -> Any:
        body = request.read()
        # httpx, or the httpx2 newer openai releases use: whichever built this request.
        http = sys.modules[type(request).__module__.split(".")[0]]

        class Trickle(http.AsyncByteStream):  # type: ignore[misc, name-defined]
            async def __aiter__(self) -> AsyncIterator[bytes]:
                yield body[:10]
                await asyncio.sleep(1.5)
                yield body[10:]

            async def aclose(self) -> None:
                pass

        request.stream = Trickle()
        return await super().send(request, **kwargs)


async def test_every_error_the_router_answers_is_an_openai_error(bus: Bus, client: openai.AsyncOpenAI,
                                                                 router: Router) -> None:
    async def raised(call: Any) -> openai.APIStatusError:
        with pytest.raises(openai.APIStatusError) as err:
            await call
        body = err.value.body  # the client read our JSON error: {"message", "type", "param", "code"}
        assert isinstance(body, dict) and body["message"] in err.value.message and body["type"], err.value.message
        return err.value

    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="wrong", max_retries=0, timeout=10) as bad:
        e = await raised(bad.chat.completions.create(model=MODEL, messages=HI))
        assert isinstance(e, openai.AuthenticationError) and e.code == "invalid_api_key"
        e = await raised(bad.models.retrieve(MODEL))
        assert isinstance(e, openai.AuthenticationError)

    e = await raised(client.chat.completions.create(model="no-such-model", messages=HI))
    assert isinstance(e, openai.NotFoundError) and e.code == "model_not_found" and e.param == "model"
    e = await raised(client.models.retrieve("no-such-model"))
    assert isinstance(e, openai.NotFoundError) and e.code == "model_not_found"

    e = await raised(client.get("/no/such/path", cast_to=object))
    assert isinstance(e, openai.NotFoundError) and e.code == "unknown_url" and "GET /v1/no/such/path" in e.message
    e = await raised(client.post("/models", cast_to=object, body={}))
    assert e.status_code == 405 and e.code == "method_not_allowed"
    assert e.response.headers["Allow"] == "GET, HEAD"
    e = await raised(client.get("/chat/completions", cast_to=object))
    assert e.status_code == 405 and e.response.headers["Allow"] == "POST"

    e = await raised(client.chat.completions.create(model="", messages=HI))
    assert isinstance(e, openai.BadRequestError) and e.code == "missing_model"
    e = await raised(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 8192}]))
    assert e.status_code == 413 and e.code == "request_too_large"

    await place(bus, "Q", "queued-model", "", state="starting")
    await router.sink.wait_for(lambda p: "queued-model" in p.known_models)
    e = await raised(client.embeddings.create(model="queued-model", input="x"))
    assert isinstance(e, openai.InternalServerError) and e.status_code == 503
    assert e.response.headers["Retry-After"] == "5"

    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0, timeout=10,
                                  http_client=_TrickleClient()) as slow:
        e = await raised(slow.chat.completions.create(model=MODEL, messages=HI))
    assert e.status_code == 408 and e.code == "request_timeout"

    got = await scrape(router.url)
    for kind, n in (("unauthorized", 2), ("unknown_model", 1), ("bad_request", 1), ("too_large", 1),
                    ("body_timeout", 1)):
        assert got[sample("llmgw_router_errors_total", model="", kind=kind)] == n, kind


async def test_metrics_speak_openmetrics_when_asked(client: openai.AsyncOpenAI, router: Router) -> None:
    await client.chat.completions.create(model=MODEL, messages=HI)
    async with aiohttp.ClientSession() as s:
        async with s.get(router.url + "/metrics") as resp:
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        async with s.get(router.url + "/metrics",
                         headers={"Accept": "application/openmetrics-text; version=1.0.0; charset=utf-8"}) as resp:
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            text = await resp.text()
    assert text.endswith("# EOF\n")
    families = {f.name: f for f in openmetrics_families(text)}
    requests = families["llmgw_router_requests"]
    assert requests.type == "counter"
    assert [x.value for x in requests.samples
            if x.name == "llmgw_router_requests_total" and x.labels.get("model") == MODEL] == [1]
    assert families["llmgw_router_request_seconds"].type == "histogram"
    assert "process_cpu_seconds" in families  # the process's own metrics, in this router's registry


def test_a_request_longer_than_the_largest_bucket_counts_in_inf_and_its_seconds_in_sum() -> None:
    metrics = Metrics(process=False)
    metrics.observe("m", "/v1/chat/completions", 200, False, 0.002)
    metrics.observe("m", "/v1/chat/completions", 200, False, LATENCY_BUCKETS[-1] + 180.0)  # a 5-minute request
    body, _ = metrics.render()
    from prometheus_client.parser import text_string_to_metric_families

    got = {sample(x.name, **x.labels): x.value
           for f in text_string_to_metric_families(body.decode()) for x in f.samples}
    labels = {"model": "m", "stream": "false"}
    assert got[sample("llmgw_router_request_seconds_bucket", **labels, le=str(LATENCY_BUCKETS[-1]))] == 1
    assert got[sample("llmgw_router_request_seconds_bucket", **labels, le="+Inf")] == 2
    assert got[sample("llmgw_router_request_seconds_count", **labels)] == 2
    assert got[sample("llmgw_router_request_seconds_sum", **labels)] == pytest.approx(0.002 + LATENCY_BUCKETS[-1] + 180.0)


def test_every_metric_and_error_kind_is_on_the_router_page(bus: Bus) -> None:
    router = Router(bus, "router-docs")
    body, _ = router.metrics.render()
    from prometheus_client.parser import text_string_to_metric_families

    names = {f.name for f in text_string_to_metric_families(body.decode())
             if f.name.startswith("llmgw_") and not f.name.endswith("_created")}  # _created: documented once
    assert len(names) >= 12
    page = ROUTER_PAGE.read_text()
    missing = [n for n in sorted(names) if f"`{n}" not in page]
    assert not missing, f"metrics docs/router.md does not document: {missing}"
    missing = [k for k in ERROR_KINDS if f"`{k}`" not in page]
    assert not missing, f"error kinds docs/router.md does not document: {missing}"


async def test_a_forced_usage_chunk_is_counted_and_reaches_only_the_clients_that_asked(bus: Bus) -> None:
    """vLLM's --enable-force-include-usage ends every stream with a usage chunk (no choices), so that a
    streamed request is counted whether its client asked for usage or not; a client that did not ask
    never expected that chunk, and code reading ``choices[0]`` of every chunk breaks on it."""
    with running_engines(F=("forced", "--chunks", "4", "--force-include-usage")) as procs:
        r = Router(bus, "router-forced", tick_s=3600)
        await r.start("127.0.0.1", 0)
        try:
            await place(bus, "F", "forced", procs["F"].url)
            await r.sink.wait_for(in_pool("F"))
            async with openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="-", max_retries=0, timeout=20) as c:
                plain = [x async for x in await c.chat.completions.create(model="forced", messages=HI, stream=True)]
                asked = [x async for x in await c.chat.completions.create(
                    model="forced", messages=HI, stream=True, stream_options={"include_usage": True})]
                text = [x async for x in await c.completions.create(model="forced", prompt="hi", stream=True)]
            assert plain and all(x.choices for x in plain) and all(x.usage is None for x in plain)
            assert all(x.choices for x in text)
            assert asked[-1].choices == [] and asked[-1].usage is not None and asked[-1].usage.completion_tokens == 4
            assert [x.choices[0].delta.content for x in plain] == [x.choices[0].delta.content for x in asked[:-1]]
            got = await scrape(r.url)
            # Every one counted, the ones whose clients did not ask included: 3 requests × 4 tokens.
            assert got[sample("llmgw_router_completion_tokens_total", model="forced")] == 12
        finally:
            await r.stop()


async def test_a_stream_is_counted_though_its_client_closes_at_done(bus: Bus) -> None:
    """The openai client closes its connection as soon as it reads ``[DONE]``; an engine ends its body
    a moment later. Counted only at the body's end, that stream's usage was lost (the handler is
    cancelled when the client goes): seen as 15 prompt tokens missing from a real vLLM's count."""
    with running_engines(L=("linger", "--chunks", "2", "--done-linger-ms", "400")) as procs:
        r = Router(bus, "router-linger", tick_s=3600)
        await r.start("127.0.0.1", 0)
        try:
            await place(bus, "L", "linger", procs["L"].url)
            await r.sink.wait_for(in_pool("L"))
            body = {"model": "linger", "messages": HI, "stream": True, "stream_options": {"include_usage": True}}
            async with aiohttp.ClientSession() as s:
                resp = await s.post(r.url + "/v1/chat/completions", json=body)
                seen = b""
                while b"[DONE]" not in seen:
                    seen += await resp.content.readany()
                resp.close()  # as openai's Stream does after [DONE]
            assert b'"usage"' in seen
            got = await scrape(r.url)
            assert got[sample("llmgw_router_completion_tokens_total", model="linger")] == 2
            assert got[sample("llmgw_router_prompt_tokens_total", model="linger")] == 3
        finally:
            await r.stop()


def test_taking_usage_chunks_out_holds_back_only_an_unfinished_event() -> None:
    from llmgw.router.openai_api import without_usage_chunks

    usage = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}\n\n'
    token = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    assert without_usage_chunks(token) == (token, b"")  # no marker: passed whole, nothing parsed
    assert without_usage_chunks(token + usage + b"data: [DONE]\n\n") == (token + b"data: [DONE]\n\n", b"")
    # The usage event cut in two by the network: the unfinished part waits for the rest.
    out, held = without_usage_chunks(token + usage[:30])
    assert (out, held) == (token, usage[:30])
    assert without_usage_chunks(held + usage[30:] + b"data: [DONE]\n\n") == (b"data: [DONE]\n\n", b"")
