"""NodeLost after missed heartbeats, NodeReturned after, each fact stored once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

from running import running, until
from streams import stored

from llmgw import messages as m
from llmgw import subjects
from llmgw.agent.node import Agent
from llmgw.agent.simnvml import SimNvml
from llmgw.bus import Bus
from llmgw.fleetfile import FleetNode, load
from llmgw.scheduler.liveness import HeartbeatMonitor

TIMEOUT_S = 1.0


async def fleet_events(bus: Bus) -> list[m.AnyEvent]:
    return await stored(bus, subjects.STREAM_FLEET, limit_s=10)


async def liveness_of(bus: Bus, node: str) -> list[type]:
    return [type(e) for e in await fleet_events(bus) if isinstance(e, m.NodeLost | m.NodeReturned) and e.node == node]


@contextlib.asynccontextmanager
async def task_of(aw: Awaitable[None]) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.ensure_future(aw)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=10)


@contextlib.asynccontextmanager
async def agent_running(bus: Bus, node: FleetNode) -> AsyncIterator[Agent]:
    agent = Agent(bus, SimNvml(node), node.name, fabric=node.fabric, simulated=True, heartbeat_s=0.1)
    async with running(agent):
        yield agent


def _node(fleet_file: Path) -> FleetNode:
    return load(fleet_file).node("l40s-01")


async def test_silent_node_is_lost_and_returns_when_heard(bus: Bus, fleet_file: Path) -> None:
    node = _node(fleet_file)
    monitor = HeartbeatMonitor(bus, timeout_s=TIMEOUT_S, check_every_s=0.1)
    async with task_of(monitor.run()):
        async with agent_running(bus, node):
            async def heard() -> bool:
                return node.name in monitor.heard

            await until(heard, "the first heartbeat")
            await asyncio.sleep(TIMEOUT_S * 1.5)  # beating all along: not lost
            assert await liveness_of(bus, node.name) == []

        async def lost() -> bool:
            return await liveness_of(bus, node.name) == [m.NodeLost]

        await until(lost, "NodeLost")
        async with agent_running(bus, node) as again:
            async def returned() -> bool:
                return await liveness_of(bus, node.name) == [m.NodeLost, m.NodeReturned]

            await until(returned, "NodeReturned")
    events = [e for e in await fleet_events(bus) if isinstance(e, m.NodeLost | m.NodeReturned)]
    lost_ev, back_ev = events
    assert isinstance(lost_ev, m.NodeLost) and lost_ev.timeout_s == TIMEOUT_S and lost_ev.last_heartbeat_at is not None
    assert isinstance(back_ev, m.NodeReturned) and back_ev.boot_id == again.boot_id


async def test_two_monitors_store_one_fact(bus: Bus, fleet_file: Path) -> None:
    node = _node(fleet_file)
    first = HeartbeatMonitor(bus, timeout_s=TIMEOUT_S, check_every_s=0.1)
    second = HeartbeatMonitor(bus, timeout_s=TIMEOUT_S, check_every_s=0.1)
    async with task_of(first.run()), task_of(second.run()):
        async with agent_running(bus, node):
            async def both_heard() -> bool:
                return node.name in first.heard and node.name in second.heard

            await until(both_heard, "heartbeats at both monitors")

        async def both_judged() -> bool:
            return node.name in first.lost and node.name in second.lost

        await until(both_judged, "both monitors to see the silence")
        async with agent_running(bus, node):
            async def both_back() -> bool:
                return node.name not in first.lost and node.name not in second.lost

            await until(both_back, "both monitors to hear the node again")
    assert await liveness_of(bus, node.name) == [m.NodeLost, m.NodeReturned]
    assert len(first.published) + len(second.published) == 4  # each tried; the server kept one of each


async def test_a_restarted_monitor_does_not_repeat_a_loss_and_skips_malformed_heartbeats(bus: Bus, fleet_file: Path) -> None:
    node = _node(fleet_file)
    monitor = HeartbeatMonitor(bus, timeout_s=TIMEOUT_S, check_every_s=0.1)
    async with task_of(monitor.run()):
        async with agent_running(bus, node):
            async def heard() -> bool:
                return node.name in monitor.heard

            await until(heard, "the first heartbeat")

        async def lost() -> bool:
            return node.name in monitor.lost

        await until(lost, "NodeLost")
    await bus.publish_core(subjects.heartbeat("garbage-node"), b"{not json")
    restarted = HeartbeatMonitor(bus, timeout_s=TIMEOUT_S, check_every_s=0.1)
    async with task_of(restarted.run()):
        await asyncio.wait_for(restarted.ready.wait(), timeout=10)

        async def skipped() -> bool:
            return restarted.malformed == 1

        await until(skipped, "the malformed heartbeat to be skipped")
        await asyncio.sleep(TIMEOUT_S)  # several checks on a node that is still silent
        assert node.name in restarted.lost and restarted.published == []
    assert await liveness_of(bus, node.name) == [m.NodeLost]


async def test_a_monitor_judges_only_the_silence_it_watched(bus: Bus) -> None:
    """A control plane back after downtime finds stale heartbeats: not proof of loss until a full timeout passes."""
    hb = m.HeartbeatSent(at=m.utcnow(), node="stale-node", boot_id="b1", seq=1)
    await bus.publish_core(subjects.heartbeat("stale-node"), m.encode(hb))
    await asyncio.sleep(TIMEOUT_S * 1.5)  # the stored heartbeat is now older than the timeout
    monitor = HeartbeatMonitor(bus, timeout_s=TIMEOUT_S, check_every_s=0.1)
    async with task_of(monitor.run()):
        await asyncio.wait_for(monitor.ready.wait(), timeout=10)

        async def heard() -> bool:
            return "stale-node" in monitor.heard

        await until(heard, "the stored heartbeat")
        assert await liveness_of(bus, "stale-node") == []  # not judged at once

        async def lost() -> bool:
            return await liveness_of(bus, "stale-node") == [m.NodeLost]

        await until(lost, "NodeLost after a full timeout of watched silence")
