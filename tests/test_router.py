"""The router with the official openai client, in front of two fake engine processes.

Endpoints are learned from replica events published on the session's real
nats-server, the way the control plane will publish them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime

import aiohttp
import openai
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from running import engines as running_engines
from running import until

from llmgw import messages as m
from llmgw import subjects
from llmgw.apikeys import hash_key
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.engine.fake import EngineProcess, spawn
from llmgw.engine.upstream import Timeouts
from llmgw.errors import ConfigError
from llmgw.router.endpoints import Pool
from llmgw.router.server import Router

MODEL = "qwen-test"


def now() -> datetime:
    return datetime.now(UTC)


def placement(rid: str, model: str, node: str = "n1") -> m.ReplicaPlaced:
    """A replica on one GPU of ``node``: the pool takes its state only from there."""
    spec = m.ModelSpec(name=model, source="x", precision="bf16", engine="vllm", gpu_class="H100", context=4096)
    return m.ReplicaPlaced(at=now(), replica_id=rid, model=model, nodes=(node,),
                           gpus=(m.GpuRef(node=node, index=0, uuid=f"GPU-{rid}"),), spec=spec)


async def place(bus: Bus, rid: str, model: str, endpoint: str, state: str = "healthy") -> None:
    """What the control plane and an agent publish for a replica that came up."""
    await bus.publish(placement(rid, model))
    await set_state(bus, rid, model, state, endpoint)


async def set_state(bus: Bus, rid: str, model: str, state: str, endpoint: str = "") -> None:
    await bus.publish(m.ReplicaStateChanged(at=now(), replica_id=rid, model=model, node="n1",
                                            state=state, endpoint=endpoint))  # type: ignore[arg-type]


def in_pool(*rids: str):  # noqa: ANN201 - a predicate for EndpointSink.wait_for
    return lambda pool: {r.replica_id for reps in pool.healthy.values() for r in reps} == set(rids)


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, EngineProcess]]:
    """Two healthy engines of one model; 150 ms replies so concurrent requests overlap."""
    slow = (MODEL, "--latency-ms", "150", "--chunks", "4")
    with running_engines(A=slow, B=slow) as procs:
        yield procs


@pytest.fixture
async def router(bus: Bus, engines: dict[str, EngineProcess]) -> AsyncIterator[Router]:
    r = Router(bus, "router-test", tick_s=3600)
    await r.start("127.0.0.1", 0)
    await place(bus, "A", MODEL, engines["A"].url)
    await place(bus, "B", MODEL, engines["B"].url)
    await r.sink.wait_for(in_pool("A", "B"))
    try:
        yield r
    finally:
        await r.stop()


@pytest.fixture
async def client(router: Router) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=20)
    try:
        yield c
    finally:
        await c.close()


async def test_chat_plain_and_streamed(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == f"hello from {reply.system_fingerprint}"
    assert reply.system_fingerprint in {"A", "B"}

    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
    pieces = [chunk.choices[0].delta.content async for chunk in stream]
    assert pieces == ["tok0 ", "tok1 ", "tok2 ", "tok3 ", ""]


async def test_completions_embeddings_and_models(client: openai.AsyncOpenAI) -> None:
    done = await client.completions.create(model=MODEL, prompt="hi")
    assert done.choices[0].text.startswith("hello from ")
    emb = await client.embeddings.create(model=MODEL, input=["a", "b", "c"])
    assert [d.index for d in emb.data] == [0, 1, 2]
    assert len(emb.data[0].embedding) == 8
    listed = await client.models.list()
    assert [x.id for x in listed.data] == [MODEL]


async def test_least_outstanding_spreads_concurrent_requests(client: openai.AsyncOpenAI, router: Router) -> None:
    # All six are acquired while the first are still outstanding (150 ms replies),
    # so least-outstanding must split them evenly.
    replies = await asyncio.gather(*(
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": str(i)}]) for i in range(6)
    ))
    assert Counter(r.system_fingerprint for r in replies) == {"A": 3, "B": 3}
    assert all(r.outstanding == 0 for r in router.pool.replicas.values())


def test_acquire_takes_least_outstanding_and_rotates_ties(bus: Bus) -> None:
    r = Router(bus, "pure")
    pool: Pool = r.pool
    for rid in ("x", "y", "z"):
        pool.apply(placement(rid, "m", "n"), 0.0)
        pool.apply(m.ReplicaStateChanged(at=now(), replica_id=rid, model="m", node="n", state="healthy",
                                         endpoint=f"http://{rid}"), 0.0)
    pool.replicas["x"].outstanding = 2
    pool.replicas["y"].outstanding = 1
    pool.replicas["z"].outstanding = 1
    picks = []
    for _ in range(4):
        rep = r.acquire("m")
        assert rep is not None
        picks.append(rep.replica_id)
        r.release(rep)
    assert "x" not in picks and set(picks) == {"y", "z"}
    assert r.acquire("nope") is None


def test_only_healthy_with_an_endpoint_is_routable() -> None:
    pool = Pool()
    pool.apply(placement("r", "m", "n"), 0.0)
    ev = m.ReplicaStateChanged
    pool.apply(ev(at=now(), replica_id="r", model="m", node="n", state="healthy"), 1.0)
    assert pool.models() == []  # healthy but nowhere to send requests
    pool.apply(ev(at=now(), replica_id="r", model="m", node="n", state="healthy", endpoint="http://h:1/"), 2.0)
    assert pool.models() == ["m"] and pool.replicas["r"].endpoint == "http://h:1"
    for state in ("unhealthy", "failed", "starting"):
        pool.apply(ev(at=now(), replica_id="r", model="m", node="n", state=state), 3.0)
        assert pool.models() == [] and "m" in pool.known_models
        pool.apply(ev(at=now(), replica_id="r", model="m", node="n", state="healthy", endpoint="http://h:1"), 4.0)
        assert pool.models() == ["m"]
    pool.apply(ev(at=now(), replica_id="r", model="m", node="n", state="stopped"), 5.0)
    assert pool.models() == [] and pool.replicas == {}


async def test_malformed_control_event_is_counted_and_skipped(bus: Bus, router: Router,
                                                              engines: dict[str, EngineProcess]) -> None:
    await bus.publish_bytes(subjects.replica("bad", "state", "n1"), b'{"type": "ReplicaStateChanged"}', "bad-1")
    await bus.publish_bytes(subjects.replica("bad", "state", "n1"), b"not json", "bad-2")
    await place(bus, "C", MODEL, engines["A"].url)
    await router.sink.wait_for(in_pool("A", "B", "C"))
    assert router.sink.bad_events == 2
    assert (await scrape(router.url))["llmgw_router_bad_events_total", frozenset()] == 2


async def test_unhealthy_replica_receives_nothing_more(bus: Bus, client: openai.AsyncOpenAI, router: Router) -> None:
    await set_state(bus, "A", MODEL, "unhealthy")
    await router.sink.wait_for(in_pool("B"))
    for _ in range(5):
        reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        assert reply.system_fingerprint == "B"
    listed = await client.models.list()
    assert [x.id for x in listed.data] == [MODEL]

    await bus.publish(m.ReplicaStopped(at=now(), replica_id="B", model=MODEL, reason="idle"))
    await router.sink.wait_for(in_pool())
    with pytest.raises(openai.APIStatusError) as err:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 503
    assert err.value.response.headers["Retry-After"] == "5"
    assert (await client.models.list()).data == []


async def test_unknown_model_is_404(client: openai.AsyncOpenAI, router: Router) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        await client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "model_not_found"
    assert "no-such-model" in err.value.message
    # A name a client made up never becomes a metrics label.
    async with aiohttp.ClientSession() as s, s.get(router.url + "/metrics") as resp:
        text = await resp.text()
    assert "no-such-model" not in text
    assert (await scrape(router.url))[sample("llmgw_router_errors_total", model="", kind="unknown_model")] == 1


async def test_model_still_starting_is_503(bus: Bus, client: openai.AsyncOpenAI, router: Router) -> None:
    await place(bus, "S", "starting-model", "", state="starting")
    await router.sink.wait_for(lambda p: "starting-model" in p.known_models)
    with pytest.raises(openai.APIStatusError) as err:
        await client.embeddings.create(model="starting-model", input="x")
    assert err.value.status_code == 503
    assert err.value.response.headers["Retry-After"] == "5"


async def test_engine_dead_before_first_byte_is_retried_elsewhere(bus: Bus, client: openai.AsyncOpenAI,
                                                                   router: Router) -> None:
    dying = spawn("flaky", "--die-on-request", name="D")
    good = spawn("flaky", name="G")
    try:
        await place(bus, "D", "flaky", dying.url)
        await place(bus, "G", "flaky", good.url)
        await router.sink.wait_for(lambda p: len(p.healthy.get("flaky", [])) == 2)
        # Eight prompts (eight keys: each the first clockwise of its own) send some to D, which dies mid-request.
        answered = [
            (await client.chat.completions.create(model="flaky", messages=[{"role": "user", "content": f"x{i}"}])).system_fingerprint
            for i in range(8)
        ]
        assert answered == ["G"] * 8
        assert dying.proc.wait(timeout=10) == 3
        assert router.metrics.retries >= 1
        assert router.metrics.errors("flaky", "upstream_connect") >= 1
    finally:
        dying.stop()
        good.stop()


async def test_only_replica_unreachable_is_502_after_one_retry(bus: Bus, client: openai.AsyncOpenAI,
                                                               router: Router) -> None:
    gone = spawn("lonely", name="L")
    gone.stop()  # killed, but the control plane has not noticed yet
    await place(bus, "L", "lonely", gone.url)
    await router.sink.wait_for(lambda p: "lonely" in p.healthy)
    with pytest.raises(openai.APIStatusError) as err:
        await client.chat.completions.create(model="lonely", messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 502
    assert "replica L of lonely could not be reached" in err.value.message
    assert router.metrics.retries == 1
    assert router.pool.replicas["L"].outstanding == 0


async def test_upstream_read_timeout_is_504(bus: Bus) -> None:
    stuck = spawn("stuck", "--latency-ms", "5000", name="T")
    r = Router(bus, "router-timeouts", tick_s=3600, timeouts=Timeouts(connect_s=2, read_s=0.3))
    await r.start("127.0.0.1", 0)
    try:
        await place(bus, "T", "stuck", stuck.url)
        await r.sink.wait_for(lambda p: "stuck" in p.healthy)
        async with openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0, timeout=20) as c:
            with pytest.raises(openai.APIStatusError) as err:
                await c.chat.completions.create(model="stuck", messages=[{"role": "user", "content": "x"}])
            assert err.value.status_code == 504
        assert r.metrics.errors("stuck", "upstream_timeout") == 1
        assert r.pool.replicas["T"].outstanding == 0
    finally:
        await r.stop()
        stuck.stop()


async def test_engine_dead_mid_stream_is_an_error_not_a_hang(bus: Bus, client: openai.AsyncOpenAI,
                                                              router: Router) -> None:
    dying = spawn("brittle", "--chunks", "10", "--die-after-chunks", "2", name="M")
    try:
        await place(bus, "M", "brittle", dying.url)
        await router.sink.wait_for(lambda p: "brittle" in p.healthy)
        got: list[str | None] = []

        async def consume() -> None:
            stream = await client.chat.completions.create(model="brittle", messages=[{"role": "user", "content": "x"}],
                                                          stream=True)
            async for chunk in stream:
                got.append(chunk.choices[0].delta.content)

        with pytest.raises(openai.APIError) as err:
            await asyncio.wait_for(consume(), timeout=20)
        assert "broke off the stream" in err.value.message
        assert got == ["tok0 ", "tok1 "]
        assert router.metrics.retries == 0
    finally:
        dying.stop()


async def test_client_disconnect_releases_the_replica(bus: Bus, router: Router) -> None:
    slow = spawn("slow", "--chunks", "200", "--chunk-interval-ms", "50", name="W")
    try:
        await place(bus, "W", "slow", slow.url)
        await router.sink.wait_for(lambda p: "slow" in p.healthy)
        async with aiohttp.ClientSession() as s:
            resp = await s.post(router.url + "/v1/chat/completions", json={"model": "slow", "stream": True})
            assert (await resp.content.readline()).startswith(b"data: ")
            assert router.pool.replicas["W"].outstanding == 1
            resp.close()
        for _ in range(100):
            if router.pool.replicas["W"].outstanding == 0:
                break
            await asyncio.sleep(0.05)
        assert router.pool.replicas["W"].outstanding == 0
        assert router.metrics.errors("slow", "upstream_broken") == 0  # the client left, not the replica
    finally:
        slow.stop()


async def test_a_client_that_leaves_is_client_closed_not_a_500(bus: Bus, router: Router,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    slow = spawn("leave", "--chunks", "400", "--chunk-interval-ms", "20", name="L")
    lazy = spawn("wait", "--latency-ms", "3000", name="Z")
    try:
        await place(bus, "L", "leave", slow.url)
        await place(bus, "Z", "wait", lazy.url)
        await router.sink.wait_for(lambda p: "leave" in p.healthy and "wait" in p.healthy)
        async with aiohttp.ClientSession() as s:
            for _ in range(3):  # streamed: gone after the first chunk
                resp = await s.post(router.url + "/v1/chat/completions", json={"model": "leave", "stream": True})
                assert (await resp.content.readline()).startswith(b"data: ")
                resp.close()
            with pytest.raises(TimeoutError):  # not streamed: gone while the engine thinks
                await s.post(router.url + "/v1/completions", json={"model": "wait", "prompt": "x"},
                             timeout=aiohttp.ClientTimeout(total=0.3))
        for _ in range(200):
            if sum(router.metrics.errors(name, "client_closed") for name in ("leave", "wait")) == 4:
                break
            await asyncio.sleep(0.05)
    finally:
        slow.stop()
        lazy.stop()
    assert router.metrics.errors("leave", "client_closed") == 3
    assert router.metrics.errors("wait", "client_closed") == 1
    assert router.metrics.requests("leave", "/v1/chat/completions", 499) == 3
    assert not [k for k, n in (await scrape(router.url)).items() if k[0] == "llmgw_router_requests_total"
                and ("code", "500") in k[1] and n]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


async def test_bad_requests_get_clear_4xx(bus: Bus, engines: dict[str, EngineProcess]) -> None:
    r = Router(bus, "router-small", tick_s=3600, max_body_bytes=1024)
    await r.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s:
            cases = [
                (b"{not json", 400, "invalid_json"),
                (b'{"messages": []}', 400, "missing_model"),
                (b'{"model": 7}', 400, "invalid_json"),
                (b'{"model": "m", "pad": "' + b"x" * 4096 + b'"}', 413, "request_too_large"),
            ]
            for body, status, code in cases:
                async with s.post(r.url + "/v1/chat/completions", data=body) as resp:
                    assert resp.status == status, body[:20]
                    assert (await resp.json())["error"]["code"] == code
            got = await scrape(r.url)
            assert got[sample("llmgw_router_errors_total", model="", kind="bad_request")] == 3
            assert got[sample("llmgw_router_errors_total", model="", kind="too_large")] == 1
    finally:
        await r.stop()


async def test_api_keys(bus: Bus, engines: dict[str, EngineProcess]) -> None:
    secret = "sk-test-1234567890"
    r = Router(bus, "router-keys", tick_s=3600, api_keys=[hash_key(secret)])
    await r.start("127.0.0.1", 0)
    await place(bus, "A", MODEL, engines["A"].url)
    await r.sink.wait_for(in_pool("A"))
    try:
        async with openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="wrong", max_retries=0, timeout=10) as c:
            with pytest.raises(openai.AuthenticationError):
                await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        async with aiohttp.ClientSession() as s, s.post(r.url + "/v1/chat/completions", json={"model": MODEL}) as resp:
            assert resp.status == 401
            assert (await resp.json())["error"]["code"] == "invalid_api_key"
        async with openai.AsyncOpenAI(base_url=r.url + "/v1", api_key=secret, max_retries=0, timeout=10) as c:
            reply = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
            assert reply.system_fingerprint == "A"
        for scheme in ("bearer", "BEARER"):  # an auth scheme is case-insensitive (RFC 9110)
            async with aiohttp.ClientSession() as s, s.get(r.url + "/v1/models",
                                                           headers={"Authorization": f"{scheme} {secret}"}) as resp:
                assert resp.status == 200, scheme
        async with aiohttp.ClientSession() as s, s.get(r.url + "/metrics") as resp:
            text = await resp.text()
        assert secret not in text and hash_key(secret) not in text
        assert (await scrape(r.url))[sample("llmgw_router_errors_total", model="", kind="unauthorized")] == 2
    finally:
        await r.stop()


async def test_metrics_and_health(client: openai.AsyncOpenAI, router: Router) -> None:
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    got = await scrape(router.url)
    async with aiohttp.ClientSession() as s, s.get(router.url + "/health") as resp:
        health = await resp.json()
    assert got[sample("llmgw_router_requests_total", model=MODEL, route="/v1/chat/completions", code="200")] == 1
    assert got[sample("llmgw_router_request_seconds_count", model=MODEL, stream="false")] == 1
    assert got[sample("llmgw_router_in_flight", replica="A", model=MODEL)] == 0
    assert got[sample("llmgw_router_replicas", state="healthy")] == 2
    assert health["status"] == "ok" and health["healthy_replicas"] == 2


def test_cli_router_bad_listen_and_key_file(tmp_path) -> None:  # noqa: ANN001
    runner = CliRunner()
    res = runner.invoke(cli, ["router", "--listen", "nonsense"])
    assert res.exit_code != 0 and "is not HOST:PORT" in res.output
    keys = tmp_path / "keys"
    keys.write_text("not-a-digest\n")
    res = runner.invoke(cli, ["router", "--api-keys", str(keys), "--nats-url", "nats://127.0.0.1:1"])
    assert res.exit_code == 1
    assert "Error:" in res.output and "not a sha256 hex digest" in res.output
    assert "Traceback" not in res.output


async def test_listen_on_a_taken_port_is_a_clear_error(bus: Bus, router: Router) -> None:
    port = int(router.url.rsplit(":", 1)[1])
    other = Router(bus, "second", tick_s=3600)
    with pytest.raises(ConfigError, match=f"router cannot listen on 127.0.0.1:{port}"):
        await other.start("127.0.0.1", port)
    assert await idle_count(bus) == 0  # a router that never served publishes nothing


def sample(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset(labels.items())


async def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """GET /metrics, parsed by prometheus_client's own parser: every sample by (name, labels)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {sample(x.name, **x.labels): x.value for family in text_string_to_metric_families(text) for x in family.samples}


async def idle_count(bus: Bus) -> int:
    return await bus.stream_last_seq(subjects.STREAM_USAGE)


async def test_the_router_sends_an_engine_the_key_its_own_nodes_agent_gave_it(bus: Bus) -> None:
    """Issue 45, finding 3: an engine refuses requests without its key; the router sends the one the agent of the
    replica's node published, and a key another node's agent publishes for that replica is not used."""
    key = "k" * 43
    engine = spawn("keyed", "--api-key", key, name="K1")
    r = Router(bus, "router-keys", tick_s=3600)
    await r.start("127.0.0.1", 0)
    try:
        await place(bus, "K1", "keyed", engine.url)
        await r.sink.wait_for(in_pool("K1"))
        async with aiohttp.ClientSession() as http:
            said: list[dict[str, object]] = []

            async def ask(url: str) -> int:
                async with http.post(url + "/v1/completions", json={"model": "keyed", "prompt": "hi"}) as resp:
                    said.append(await resp.json())
                    return resp.status

            assert await ask(engine.url) == 401  # straight at it, without the key
            await bus.publish(m.EngineKeyIssued(at=now(), replica_id="K1", node="n2", key="f" * 43, endpoint=engine.url))
            await until(lambda: r.engine_keys.applied_seq >= 1, "the router read n2's key")
            # n2 does not hold K1: the engine refuses the router, which is the router's problem, not the client's
            # key: a 502 that says so, never the engine's 401 passed on as if the client's key were refused.
            assert r.engine_keys.key_for(engine.url) is None and await ask(r.url) == 502
            error = said[-1]["error"]
            assert isinstance(error, dict) and error["code"] == "upstream_refused" and "engine key" in error["message"]
            await bus.publish(m.EngineKeyIssued(at=now(), replica_id="K1", node="n1", key=key, endpoint=engine.url))
            await until(lambda: r.engine_keys.key_for(engine.url) == key, "the router read n1's key")
            assert await ask(r.url) == 200
    finally:
        await r.stop()
        engine.stop()


async def test_a_request_retried_on_another_replica_carries_that_replicas_key(bus: Bus) -> None:
    """The engine's headers are built once per request and completed with each replica's key as it is
    asked (``Upstream.post``): a retry after a dead replica sends the live one's key, not the dead one's."""
    live_key, dead_key = "l" * 43, "d" * 43
    engine = spawn("retried", "--api-key", live_key, name="R2")
    dead = "http://127.0.0.1:9"  # discard: nothing listens, so every connect is refused
    r = Router(bus, "router-retry-keys", tick_s=3600)
    await r.start("127.0.0.1", 0)
    try:
        await place(bus, "R1", "retried", dead)
        await place(bus, "R2", "retried", engine.url)
        await r.sink.wait_for(in_pool("R1", "R2"))
        await bus.publish(m.EngineKeyIssued(at=now(), replica_id="R1", node="n1", key=dead_key, endpoint=dead))
        await bus.publish(m.EngineKeyIssued(at=now(), replica_id="R2", node="n1", key=live_key, endpoint=engine.url))
        await until(lambda: r.engine_keys.key_for(dead) == dead_key and r.engine_keys.key_for(engine.url) == live_key,
                    "the router read both keys")
        async with aiohttp.ClientSession() as http:
            for _ in range(4):  # ties rotate: the dead replica is asked first in some of them
                async with http.post(r.url + "/v1/completions", json={"model": "retried", "prompt": "hi"}) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["x-llmgw-replica"] == "R2"
    finally:
        await r.stop()
        engine.stop()
