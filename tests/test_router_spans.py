"""OpenTelemetry spans (the ``otel`` extra): router → replica, the id and the engine's timings, in the SDK's
in-memory exporter; the ``traceparent`` the engine was sent is the replica span's."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from click.testing import CliRunner
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from running import engines as running_engines
from test_router import in_pool, place

from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.engine.fake import EngineProcess
from llmgw.errors import ConfigError
from llmgw.router import spans as spanmod
from llmgw.router.access import Trace
from llmgw.router.metrics import usage_of
from llmgw.router.server import Router

MODEL = "span-model"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineProcess]:
    with running_engines(S=(MODEL,)) as procs:
        yield procs["S"]


@pytest.fixture
def exported() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    yield provider, memory
    provider.shutdown()


@pytest.fixture
async def router(bus: Bus, engine: EngineProcess, exported: tuple[TracerProvider, InMemorySpanExporter]
                 ) -> AsyncIterator[Router]:
    r = Router(bus, "router-spans", tick_s=3600, tracer_provider=exported[0])
    await r.start("127.0.0.1", 0)
    await place(bus, "S", MODEL, engine.url)
    await r.sink.wait_for(in_pool("S"))
    try:
        yield r
    finally:
        await r.stop()


async def test_a_request_is_a_router_span_over_a_replica_span_the_engine_joins(
        router: Router, engine: EngineProcess, exported: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    memory = exported[1]
    async with aiohttp.ClientSession() as s:
        async with s.post(router.url + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                          headers={"X-Request-Id": "span-1"}) as resp:
            assert resp.status == 200
            usage = (await resp.json())["usage"]
        async with s.post(router.url + CHAT, json={"model": "nope"}, headers={"X-Request-Id": "span-404"}) as resp:
            assert resp.status == 404
        async with s.get(router.url + "/health") as resp:
            assert resp.status == 200
        async with s.get(engine.url + "/stats") as resp:
            sent = (await resp.json())["traceparents"][-1]
    done = {(x.name, x.attributes["llmgw.request_id"]): x for x in memory.get_finished_spans()}  # type: ignore[index]
    assert sorted(done) == [("POST /v1/chat/completions", "span-1"), ("POST /v1/chat/completions", "span-404"),
                            ("llmgw.replica", "span-1")]  # /health is no traced request
    server, replica = done["POST /v1/chat/completions", "span-1"], done["llmgw.replica", "span-1"]
    assert server.kind == SpanKind.SERVER and replica.kind == SpanKind.CLIENT
    assert replica.parent is not None and replica.parent.span_id == server.context.span_id
    assert replica.context.trace_id == server.context.trace_id
    # What the engine was sent is the replica span: an engine that traces joins this trace under it.
    assert sent.rsplit("-", 1)[0] == f"00-{replica.context.trace_id:032x}-{replica.context.span_id:016x}"
    attrs: dict[str, Any] = dict(server.attributes or {})
    assert {k: attrs[k] for k in ("http.response.status_code", "gen_ai.request.model", "gen_ai.usage.input_tokens",
                                  "gen_ai.usage.output_tokens", "llmgw.router", "llmgw.caller")} == {
        "http.response.status_code": 200, "gen_ai.request.model": MODEL,
        "gen_ai.usage.input_tokens": usage["prompt_tokens"], "gen_ai.usage.output_tokens": usage["completion_tokens"],
        "llmgw.router": "router-spans", "llmgw.caller": "-"}
    assert (replica.attributes or {})["llmgw.replica"] == "S"
    assert server.start_time is not None and replica.start_time is not None and server.end_time is not None
    assert server.start_time <= replica.start_time and replica.end_time <= server.end_time  # type: ignore[operator]
    lost = done["POST /v1/chat/completions", "span-404"]
    assert lost.status.status_code == StatusCode.ERROR and (lost.attributes or {})["error.type"] == "model_not_found"


def test_the_replica_span_carries_the_engines_own_timings(
        exported: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, memory = exported
    spans = spanmod.Spans(provider)
    tr = Trace("t-1", spans)
    headers = spans.engine(tr, CHAT)
    assert headers["traceparent"].startswith("00-")
    usage = usage_of(b'{"usage":{"prompt_tokens":12,"completion_tokens":8},'
                     b'"timings":{"cache_n":4,"prompt_ms":10.5,"predicted_ms":80.25}}')  # llama-server's answer
    assert usage is not None and usage.cached_tokens == 4
    tr.counted(usage)
    tr.ended(MODEL, False, 200)
    spans.end(tr, m.AccessLine(at=tr.at, id=tr.id, route=CHAT, model=MODEL, replica="S", status=200,
                               prompt_tokens=12, completion_tokens=8, cached_tokens=4))
    (replica,) = [x for x in memory.get_finished_spans() if x.name == "llmgw.replica"]
    assert {k: v for k, v in (replica.attributes or {}).items() if k.startswith("llmgw.engine.")} == {
        "llmgw.engine.prompt_ms": 10.5, "llmgw.engine.predicted_ms": 80.25}


def test_an_otlp_endpoint_exports_in_batches_and_needs_the_extra_only_when_given() -> None:
    provider = spanmod.otlp_provider("http://127.0.0.1:1/", "r1")
    try:
        (processor,) = provider._active_span_processor._span_processors
        assert type(processor).__name__ == "BatchSpanProcessor"
        assert provider.resource.attributes["service.name"] == "llmgw-router"
    finally:
        provider.shutdown()
    with pytest.raises(ConfigError, match="must be an http"):
        spanmod.otlp_provider("collector:4318", "r1")


def test_cli_router_refuses_an_otlp_endpoint_that_is_no_url() -> None:
    res = CliRunner().invoke(cli, ["router", "--otlp-endpoint", "collector:4318", "--nats-url", "nats://127.0.0.1:1"])
    assert res.exit_code == 2 and "'collector:4318' is not an http(s) URL" in res.output, res.output
