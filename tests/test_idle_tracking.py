"""Idle maps on a real nats-server: exactly the replicas that were asked for, and
nothing that a restarted router could mistake for idleness."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime

import aiohttp
import pytest
from running import engines as running_engines
from streams import stored

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.config import Settings
from llmgw.engine.fake import EngineProcess
from llmgw.fleet.state import FleetState, apply
from llmgw.router.endpoints import Pool
from llmgw.router.idle import IdleFor, IdleTracker
from llmgw.router.server import Router


def placement(rid: str, model: str, node: str) -> m.ReplicaPlaced:
    """The placement a pool needs before it believes a replica's state."""
    spec = m.ModelSpec(name=model, source="x", precision="bf16", engine="vllm", gpu_class="H100", context=4096)
    return m.ReplicaPlaced(at=datetime.now(UTC), replica_id=rid, model=model, nodes=(node,), spec=spec,
                           gpus=(m.GpuRef(node=node, index=0, uuid=f"GPU-{rid}"),))


async def up(bus: Bus, rid: str, model: str, endpoint: str) -> None:
    await bus.publish(placement(rid, model, "n1"))
    await bus.publish(m.ReplicaStateChanged(at=datetime.now(UTC), replica_id=rid, model=model, node="n1",
                                            state="healthy", endpoint=endpoint))


async def idle_maps(bus: Bus) -> list[m.IdleMapPublished]:
    return [e for e in await stored(bus, subjects.STREAM_USAGE) if isinstance(e, m.IdleMapPublished)]


async def ask(url: str, model: str) -> str:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json={"model": model}) as resp:
        assert resp.status == 200
        return resp.headers["x-llmgw-replica"]


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, EngineProcess]]:
    with running_engines(A=("model-a",), B=("model-b",)) as procs:
        yield procs


@pytest.fixture
async def router(bus: Bus, engines: dict[str, EngineProcess]) -> AsyncIterator[Router]:
    r = Router(bus, "idle-router", tick_s=3600)
    await r.start("127.0.0.1", 0)
    await up(bus, "A", "model-a", engines["A"].url)
    await up(bus, "B", "model-b", engines["B"].url)
    await r.sink.wait_for(lambda p: set(p.models()) == {"model-a", "model-b"})
    try:
        yield r
    finally:
        await r.stop()


def test_idle_for_is_a_value_and_a_flag() -> None:
    tracker = IdleTracker()
    assert tracker.idle_for("never-seen", now=1000.0) == IdleFor(-1.0, False)
    tracker.last["r1"] = 940.0
    assert tracker.idle_for("r1", now=1000.0) == IdleFor(60.0, True)
    # A clock that stepped back never yields a negative idle time that looks known.
    assert tracker.idle_for("r1", now=900.0) == IdleFor(0.0, True)


def test_idle_map_without_requests_lists_pooled_replicas_as_serving_since() -> None:
    pool = Pool()
    for rid in ("r1", "r2"):
        pool.apply(placement(rid, "m", "n"), 1_000_000.0)
    pool.apply(m.ReplicaStateChanged(at=datetime.now(UTC), replica_id="r1", model="m", node="n", state="healthy",
                                     endpoint="http://x"), 1_000_000.0)
    pool.apply(m.ReplicaStateChanged(at=datetime.now(UTC), replica_id="r2", model="m", node="n", state="starting"),
               1_000_000.0)
    at = datetime(2026, 1, 1, tzinfo=UTC)
    event = IdleTracker().idle_map("r", "boot", pool, at)
    assert event.last_request == {}
    assert event.serving_since == {"r1": datetime.fromtimestamp(1_000_000.0, UTC)}
    assert event.tick == 1 and event.at == at


def test_stopped_replicas_leave_the_map() -> None:
    pool = Pool()
    for rid in ("r1", "r2"):
        pool.apply(placement(rid, "m", "n"), 1000.0)
        pool.apply(m.ReplicaStateChanged(at=datetime.now(UTC), replica_id=rid, model="m", node="n", state="healthy",
                                         endpoint=f"http://{rid}"), 1000.0)
    tracker = IdleTracker()
    tracker.last.update({"r1": 1001.0, "r2": 1002.0})
    pool.apply(m.ReplicaStopped(at=datetime.now(UTC), replica_id="r2", model="m", reason="idle"), 1003.0)
    event = tracker.idle_map("r", "boot", pool, datetime.now(UTC))
    assert set(event.last_request) == {"r1"} and event.serving_since == {}


async def test_idle_map_holds_exactly_the_replicas_asked_for(bus: Bus, router: Router) -> None:
    before = datetime.now(UTC)
    for _ in range(3):
        assert await ask(router.url, "model-a") == "A"
    after = datetime.now(UTC)
    assert router.idle_for("A").known and not router.idle_for("B").known

    await router.publish_idle_map()
    (event,) = await idle_maps(bus)
    assert event.router == "idle-router" and event.boot_id == router.boot_id
    assert set(event.last_request) == {"A"}
    assert before <= event.last_request["A"] <= after
    # B was routable but nobody asked: "nobody since X", and X is when this router learned of it.
    assert set(event.serving_since) == {"B"}
    assert event.serving_since["B"] <= before


async def test_ticker_publishes_without_being_asked(bus: Bus, engines: dict[str, EngineProcess]) -> None:
    r = Router(bus, "ticking", tick_s=0.2)
    await r.start("127.0.0.1", 0)
    try:
        for _ in range(100):
            maps = await idle_maps(bus)
            if len(maps) >= 2:
                break
            await asyncio.sleep(0.1)
        assert len(maps) >= 2
        assert [x.tick for x in maps[:2]] == [1, 2]
        assert {x.boot_id for x in maps} == {r.boot_id}
    finally:
        await r.stop()


async def test_a_restarted_router_takes_up_its_last_map_and_claims_nothing_more(
    bus: Bus, engines: dict[str, EngineProcess]
) -> None:
    first = Router(bus, "restarting", tick_s=3600)
    await first.start("127.0.0.1", 0)
    await up(bus, "A", "model-a", engines["A"].url)
    await first.sink.wait_for(lambda p: "model-a" in p.models())
    await ask(first.url, "model-a")
    await first.stop()
    # Stopping published the requests since the last tick: nothing is lost to a restart.
    (final,) = [x for x in await idle_maps(bus) if x.boot_id == first.boot_id]
    assert set(final.last_request) == {"A"}

    second = Router(bus, "restarting", tick_s=3600)
    await second.start("127.0.0.1", 0)
    other = Router(bus, "never-asked", tick_s=3600)  # another name: its own last map is none
    await other.start("127.0.0.1", 0)
    try:
        await second.sink.wait_for(lambda p: "model-a" in p.models())
        event = await second.publish_idle_map()
        assert event.boot_id != first.boot_id
        # It takes up its own last map: A was last asked when it was, not "just now" nor never.
        assert event.last_request == final.last_request and "A" not in event.serving_since
        assert second.idle_for("A").known
        fresh = await other.publish_idle_map()
        assert fresh.last_request == {} and "A" in fresh.serving_since  # it has seen no request: it claims none

        # Folded as the projector folds it, A's idleness runs from its last request, across the restart,
        # and the router with a new name, which began routing to A after it, does not restart it.
        state = FleetState()
        for e in await idle_maps(bus):
            apply(state, e)
        assert state.idle_since("A") == final.last_request["A"]

        # A request afterwards moves it, with its own time.
        t0 = time.time()
        await ask(second.url, "model-a")
        seen = second.idle_for("A")
        assert seen.known and seen.seconds <= time.time() - t0
        event = await second.publish_idle_map()
        assert set(event.last_request) == {"A"} and event.last_request["A"] > final.last_request["A"]
    finally:
        await second.stop()
        await other.stop()


async def test_tracking_off_writes_no_times(bus: Bus, engines: dict[str, EngineProcess]) -> None:
    r = Router(bus, "untracked", tick_s=0.1, idle_tracking=False)
    await r.start("127.0.0.1", 0)
    try:
        await up(bus, "A", "model-a", engines["A"].url)
        await r.sink.wait_for(lambda p: "model-a" in p.models())
        await ask(r.url, "model-a")
        assert r.idle.last == {}
        assert not [t for t in asyncio.all_tasks() if t.get_name() == "router-idle"]
        assert await idle_maps(bus) == []
    finally:
        await r.stop()


async def test_cli_router_publishes_a_last_map_on_sigterm(bus: Bus, settings: Settings,
                                                         engines: dict[str, EngineProcess]) -> None:
    await up(bus, "A", "model-a", engines["A"].url)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llmgw", "router", "--listen", "127.0.0.1:0",
        "--name", "cli-router", "--tick", "3600", "--nats-url", settings.nats_url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        url = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode().strip()  # type: ignore[union-attr]
        assert url.startswith("http://127.0.0.1:")
        assert await ask(url, "model-a") == "A"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    (event,) = await idle_maps(bus)
    assert event.router == "cli-router" and set(event.last_request) == {"A"}
