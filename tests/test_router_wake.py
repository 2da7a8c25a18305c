"""The router holds requests for a parked model, wishes for it once, and lets them through when it serves.

Real nats-server, a real router, and a fake engine process that plays the
replica the scheduler would have placed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import aiohttp
import openai
import pytest
from running import engines as running_engines
from running import until
from streams import stored

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.router.server import Router

MODEL = "parked-model"


def now() -> datetime:
    return datetime.now(UTC)


def spec(name: str = MODEL) -> m.ModelSpec:
    return m.ModelSpec(name=name, source="x", precision="bf16", engine="vllm", gpu_class="H100", context=4096,
                       idle_ttl_s=60.0)


async def wishes(bus: Bus) -> list[m.ModelWanted]:
    last = await bus.stream_last_seq(subjects.STREAM_USAGE)
    out: list[m.ModelWanted] = []
    if last:
        async for batch in bus.reader(subjects.STREAM_USAGE, 1, stop_at=last).batches():
            out += [e for x in batch if isinstance(e := m.decode_event(x.data), m.ModelWanted)]
    return out


async def serve_replica(bus: Bus, rid: str, model: str, endpoint: str) -> None:
    """What the scheduler and an agent publish when they answer the wish."""
    await bus.publish(m.ReplicaPlaced(at=now(), replica_id=rid, model=model, nodes=("n1",),
                                      gpus=(m.GpuRef(node="n1", index=0, uuid=f"GPU-{rid}"),), spec=spec(model)))
    await bus.publish(m.ReplicaStateChanged(at=now(), replica_id=rid, model=model, node="n1", state="healthy",
                                            endpoint=endpoint))


async def refusal(router: Router, client_timeout_s: float) -> openai.APIStatusError:
    """What an openai client hears when it asks the router for MODEL and is refused."""
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="-", max_retries=0, timeout=client_timeout_s)
    try:
        with pytest.raises(openai.APIStatusError) as err:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    finally:
        await client.close()
    return err.value


@pytest.fixture
async def router(bus: Bus) -> AsyncIterator[Router]:
    await bus.publish(m.ModelDeclared(at=now(), spec=spec()))
    r = Router(bus, "gw-wake", tick_s=3600, wake_timeout_s=30)
    await r.start("127.0.0.1", 0)
    await r.sink.wait_for(lambda p: MODEL in p.declared)
    try:
        yield r
    finally:
        await r.stop()


async def test_a_burst_for_a_parked_model_is_held_wished_for_once_and_served_in_order(bus: Bus, router: Router) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    n = 500
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def ask(i: int) -> tuple[int, str]:
            async with session.post(router.url + "/v1/chat/completions", json=body) as resp:
                return resp.status, await resp.text()

        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="-", max_retries=0, timeout=60)
        try:
            tasks = [asyncio.create_task(ask(i)) for i in range(n)]

            async def streamed() -> str:
                stream = await client.chat.completions.create(model=MODEL, stream=True,
                                                              messages=[{"role": "user", "content": "hi"}])
                return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

            stream_task = asyncio.create_task(streamed())
            await until(lambda: len(router.waiting.get(MODEL, ())) == n + 1, "every request held", 30)
            listed = await client.models.list()
            assert [(x.id, x.model_extra["state"]) for x in listed.data] == [(MODEL, "parked")]
            held_map = router.idle.idle_map(router.name, router.boot_id, router.pool, now(), router._queued())
            assert held_map.load[MODEL] == m.ModelLoad(in_flight=0, queued=n + 1, replicas=0)
            await until(lambda: router.wishes == 1, "the wish stored", 10)
            with running_engines(R=(MODEL,)) as procs:
                await serve_replica(bus, f"{MODEL}-r2", MODEL, procs["R"].url)
                results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
                text = await asyncio.wait_for(stream_task, 60)
        finally:
            await client.close()
    assert [status for status, _ in results] == [200] * n
    assert all(json.loads(t)["system_fingerprint"] == "R" for _, t in results)
    assert text  # the streamed reply arrived whole, after the wake
    got = await wishes(bus)
    assert [(w.router, w.model, w.waiting) for w in got] == [("gw-wake", MODEL, 1)]  # one per tick, not per request
    assert got[0].control_seq == 1  # it had seen the declaration
    assert router.waiting == {}  # nothing left behind
    # /metrics counts the wake, every held request and how long each waited.
    value = router.metrics.registry.get_sample_value
    assert value("llmgw_router_wakes_total", {"model": MODEL}) == 1
    assert value("llmgw_router_held_requests_total", {"model": MODEL, "outcome": "served"}) == n + 1
    assert value("llmgw_router_wake_wait_seconds_count", {"model": MODEL}) == n + 1
    assert value("llmgw_router_wake_wait_seconds_sum", {"model": MODEL}) > 0
    listed = await client_models(router)
    assert listed[MODEL]["created"] > 1_700_000_000  # when it was declared, not 0


async def client_models(router: Router) -> dict[str, dict[str, object]]:
    async with aiohttp.ClientSession() as http, http.get(router.url + "/v1/models") as resp:
        return {x["id"]: x for x in (await resp.json())["data"]}


async def test_past_the_wake_timeout_the_client_hears_the_model_is_starting(bus: Bus, router: Router) -> None:
    router.wake_timeout_s = 0.5
    err = await refusal(router, 20)
    assert router.metrics.registry.get_sample_value("llmgw_router_held_requests_total",
                                                    {"model": MODEL, "outcome": "timeout"}) == 1
    assert err.status_code == 503
    assert err.response.headers["Retry-After"] == "5"
    assert err.code == "model_starting"
    assert "is starting" in err.message
    assert router.waiting == {}


async def test_an_unplaceable_model_answers_at_once_with_the_schedulers_reason(bus: Bus, router: Router) -> None:
    reason = "needs 1 × H100 on one node; fabric ib-a has none free"
    await bus.publish(m.ModelUnplaceable(at=now(), name=MODEL, reason=reason))
    await router.sink.wait_for(lambda p: p.model_state(MODEL) == "unplaceable")
    err = await refusal(router, 5)
    assert err.status_code == 503 and err.code == "model_unplaceable"
    assert reason in err.message
    await until(lambda: router.wishes == 1, "the demand recorded all the same", 10)


async def test_held_requests_hear_at_once_when_the_wake_turns_out_unplaceable(bus: Bus, router: Router) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        task = asyncio.create_task(session.post(router.url + "/v1/chat/completions", json=body))
        await until(lambda: MODEL in router.waiting, "the request held", 10)
        await bus.publish(m.ModelUnplaceable(at=now(), name=MODEL, reason="no room"))
        resp = await asyncio.wait_for(task, 10)
        data = await resp.json()
        resp.release()
    assert resp.status == 503 and data["error"]["code"] == "model_unplaceable"


async def test_a_router_stopping_answers_its_held_requests_and_its_wish_stays(bus: Bus, router: Router) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        task = asyncio.create_task(session.post(router.url + "/v1/chat/completions", json=body))
        await until(lambda: router.wishes == 1, "the wish stored", 10)
        await router.stop()  # a restart: the held request hears so at once, it does not hang
        resp = await asyncio.wait_for(task, 10)
        resp.release()
    assert resp.status == 503
    assert [w.model for w in await wishes(bus)] == [MODEL]  # the scheduler still places it


async def test_an_operator_stopped_model_is_not_listed_and_refused_at_once(bus: Bus, router: Router) -> None:
    await bus.publish(m.ModelScaled(at=now(), name=MODEL, replicas=0))
    await router.sink.wait_for(lambda p: p.model_state(MODEL) == "stopped")
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="-", max_retries=0, timeout=5)
    try:
        assert (await client.models.list()).data == []
    finally:
        await client.close()
    err = await refusal(router, 5)
    assert err.status_code == 503 and err.code == "model_stopped"
    assert f"llmgw ctl model scale {MODEL} --replicas 1" in err.message
    assert await wishes(bus) == []


async def test_a_held_request_wishes_again_each_tick_while_parked_not_while_starting(bus: Bus, router: Router) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        task = asyncio.create_task(session.post(router.url + "/v1/chat/completions", json=body))
        await until(lambda: router.wishes == 1, "the first wish", 10)
        await router.publish_idle_map()  # a tick with the model still parked: asked again (a wish may be lost)
        await until(lambda: router.wishes == 2, "the wish repeated while parked", 10)
        await bus.publish(m.ReplicaPlaced(at=now(), replica_id=f"{MODEL}-r2", model=MODEL, nodes=("n1",),
                                          gpus=(m.GpuRef(node="n1", index=0, uuid="GPU-x"),), spec=spec()))
        await router.sink.wait_for(lambda p: p.model_state(MODEL) == "starting")
        for _ in range(3):
            await router.publish_idle_map()
        await asyncio.sleep(0.2)  # a wish would be on its way by now
        assert router.wishes == 2  # starting: the scheduler has answered, nothing more to ask
        router.wake_timeout_s = 0.01
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_router_stopping_before_its_tick_still_says_when_its_wake_answered(bus: Bus, router: Router) -> None:
    """The ledger's router part goes out with the last map, not only at the next tick (which never comes)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session:
        held = asyncio.create_task(session.post(router.url + "/v1/chat/completions", json=body))
        await until(lambda: len(router.waiting.get(MODEL, ())) == 1, "the request held", 10)
        with running_engines(R=(MODEL,)) as procs:
            await serve_replica(bus, f"{MODEL}-r2", MODEL, procs["R"].url)
            resp = await asyncio.wait_for(held, 30)
            assert resp.status == 200
            resp.release()
            await router.stop()  # its tick is an hour away: only the stop can say it
    answered = [e for e in await stored(bus, subjects.STREAM_USAGE) if isinstance(e, m.WakeAnswered)]
    assert [(e.model, e.replica_id, e.requests) for e in answered] == [(MODEL, f"{MODEL}-r2", 1)]
