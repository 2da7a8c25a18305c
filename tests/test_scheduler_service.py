"""Two schedulers against a real nats-server: one decides, none ever places on a held GPU."""

from __future__ import annotations

import asyncio

from running import until
from streams import stored

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.config import Settings
from llmgw.fleet.state import FleetState, apply
from llmgw.fleetfile import FleetNode, inventory
from llmgw.scheduler.service import SchedulerService


def spec(name: str, tp: int, replicas: int = 1, pp: int = 1) -> m.ModelSpec:
    return m.ModelSpec(name=name, source=f"org/{name}", precision="bf16", engine="vllm",
                       gpu_class="H100-80GB", context=4096, tp=tp, pp=pp, replicas=replicas)


async def control_events(bus: Bus) -> list[m.AnyEvent]:
    return await stored(bus, subjects.STREAM_CONTROL)


def assert_never_double_placed(events: list[m.Event]) -> FleetState:
    """Replay the control history and check, after every event, that no GPU has two holders."""
    state = FleetState()
    for e in events:
        if isinstance(e, m.ReplicaPlaced):
            held = state.held_gpus()
            clash = [(g.node, g.index) for g in e.gpus if (g.node, g.index) in held]
            assert not clash, f"{e.replica_id} placed on GPUs already held: {clash}"
        apply(state, e)
    return state


async def test_two_schedulers_never_place_on_the_same_gpu(bus: Bus, settings: Settings) -> None:
    nodes = [FleetNode(name=f"n{i}", fabric="ib-a", gpu_class="H100-80GB", gpu_count=4, gpu_memory_mib=81559) for i in range(3)]
    for n in nodes:
        await bus.publish(inventory(n, m.utcnow()))
    # 12 GPUs, 14 wanted: someone must be refused, and nobody may share.
    for name, tp, replicas in [("a", 2, 3), ("b", 4, 1), ("c", 1, 4)]:
        await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec(name, tp, replicas)))
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec("big", 4, pp=2)))

    buses = [await Bus.connect(settings, f"sched-{i}") for i in range(2)]
    scheds = [SchedulerService(b, name=f"s{i}", lease_ttl_s=2.0, tick_s=0.1) for i, b in enumerate(buses)]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(s.run(stop)) for s in scheds]
    try:
        await until(lambda: sum(s.stats.decisions for s in scheds) >= 8, "eight placement decisions between the schedulers", 15)
        await asyncio.sleep(0.5)
        # Exactly one of them decided.
        assert sorted(s.stats.decisions > 0 for s in scheds) == [False, True]
        leader = next(s for s in scheds if s.stats.decisions)
        follower = next(s for s in scheds if not s.stats.decisions)

        # Hand over: the leader stops, the follower takes the lease and serves a new model.
        leader_task = tasks[scheds.index(leader)]
        # Cancelling run() releases the lease on the way out, so no TTL wait.
        leader_task.cancel()
        await asyncio.gather(leader_task, return_exceptions=True)
        assert not leader.lease.held
        await bus.publish(m.ModelRemoved(at=m.utcnow(), name="a"))
        await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec("d", 2, replicas=2)))
        # a's three replicas are stopped and their GPUs (2 per node) go to d.
        await until(lambda: sorted(e.model for e in follower.published if isinstance(e, m.ReplicaPlaced)) == ["d", "d"], "the follower placing both replicas of d", 15)
        assert sorted(e.replica_id for e in follower.published if isinstance(e, m.ReplicaStopped)) == ["a-r1", "a-r2", "a-r3"]
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for b in buses:
            await b.close()

    events = await control_events(bus)
    state = assert_never_double_placed(events)
    placed = [e for e in events if isinstance(e, m.ReplicaPlaced)]
    assert len({e.replica_id for e in placed}) == len(placed)
    unplaceable = {e.name: e.reason for e in events if isinstance(e, m.ModelUnplaceable)}
    assert "big" in unplaceable and "needs 2 nodes with 4 × H100-80GB each, in one fabric" in unplaceable["big"]
    assert sum(len(r.gpus) for r in state.replicas.values()) <= 12


async def test_lease_expires_when_holder_dies_silently(bus: Bus, settings: Settings) -> None:
    await bus.publish(inventory(FleetNode(name="n0", fabric="f", gpu_class="H100-80GB", gpu_count=2, gpu_memory_mib=81559), m.utcnow()))
    first_bus, second_bus = await Bus.connect(settings, "s1"), await Bus.connect(settings, "s2")
    first = SchedulerService(first_bus, name="first", lease_ttl_s=1.0, tick_s=0.1)
    second = SchedulerService(second_bus, name="second", lease_ttl_s=1.0, tick_s=0.1)
    try:
        assert await first.lease.acquire()
        assert not await second.lease.acquire()
        # The first "dies" without releasing; after the TTL the second gets the lease
        # and the first's stale revision can no longer renew it.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not await second.lease.acquire():
            assert loop.time() < deadline, "lease never expired"
            await asyncio.sleep(0.2)
        assert not await first.lease.renew()
    finally:
        await first_bus.close()
        await second_bus.close()


async def test_malformed_event_is_skipped_and_placement_goes_on(bus: Bus, settings: Settings) -> None:
    await bus.publish(inventory(FleetNode(name="n0", fabric="f", gpu_class="H100-80GB", gpu_count=2, gpu_memory_mib=81559), m.utcnow()))
    await bus.publish_bytes(subjects.model("junk", "declared"), b'{"type":"ModelDeclared","spec":42}', "junk-1")
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec("ok", 2)))
    b = await Bus.connect(settings, "s")
    sched = SchedulerService(b, tick_s=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(sched.run(stop))
    try:
        await until(lambda: any(isinstance(e, m.ReplicaPlaced) for e in sched.published), "a placement", 15)
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
        await b.close()
    assert sched.stats.malformed == 1
    (placed,) = [e for e in sched.published if isinstance(e, m.ReplicaPlaced)]
    assert placed.model == "ok" and len(placed.gpus) == 2


async def test_node_lost_from_silence_is_re_placed(bus: Bus, settings: Settings) -> None:
    """Heartbeats stop → the liveness monitor records NodeLost → the replica moves to the live node."""
    from llmgw.scheduler.liveness import HeartbeatMonitor

    for name in ("a-quiet", "b-chatty"):
        await bus.publish(inventory(FleetNode(name=name, fabric="f", gpu_class="H100-80GB", gpu_count=2, gpu_memory_mib=81559), m.utcnow()))
    # Only "b-chatty" keeps sending heartbeats; "a-quiet" sent one and then nothing.
    await bus.publish(m.HeartbeatSent(at=m.utcnow(), node="a-quiet", boot_id="b", seq=1))
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec("x", 2)))
    b = await Bus.connect(settings, "s")

    async def liveness(lb: Bus) -> None:
        await HeartbeatMonitor(lb, timeout_s=2.0, check_every_s=0.2).run()

    sched = SchedulerService(b, tick_s=0.1, services=(liveness,))
    stop = asyncio.Event()
    task = asyncio.create_task(sched.run(stop))

    async def beat() -> None:
        seq = 0
        while True:
            seq += 1
            await bus.publish(m.HeartbeatSent(at=m.utcnow(), node="b-chatty", boot_id="b", seq=seq))
            await asyncio.sleep(0.2)

    beats = asyncio.create_task(beat())
    try:
        await until(lambda: any(isinstance(e, m.ReplicaPlaced) and e.nodes == ("b-chatty",) for e in sched.published), "a placement on b-chatty", 15)
    finally:
        beats.cancel()
        stop.set()
        await asyncio.gather(task, beats, return_exceptions=True)
        await b.close()
    kinds = [(type(e).__name__, getattr(e, "nodes", ())) for e in sched.published]
    # Best fit put it on "a-quiet" first (equal free, name order), then NodeLost moved it.
    assert kinds[0] == ("ReplicaPlaced", ("a-quiet",))
    assert kinds[1][0] == "ReplicaStopped" and kinds[2] == ("ReplicaPlaced", ("b-chatty",))
    stopped = sched.published[1]
    assert isinstance(stopped, m.ReplicaStopped) and stopped.reason == "re-placing: node a-quiet lost (no heartbeat)"
    assert stopped.code == "node_lost"
