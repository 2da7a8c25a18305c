"""The liveness monitor across a nats-server outage: the silence it could not watch is no node's fault."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import pytest
from running import running, until
from streams import stored

from llmgw import messages as m
from llmgw import subjects
from llmgw.agent.node import Agent
from llmgw.agent.simnvml import SimNvml
from llmgw.bus import Bus
from llmgw.bus.server import EmbeddedServer, free_port
from llmgw.config import Settings
from llmgw.fleetfile import load
from llmgw.scheduler.liveness import HeartbeatMonitor

pytestmark = pytest.mark.slow
TIMEOUT_S = 1.0


async def test_an_outage_longer_than_the_timeout_loses_no_node(tmp_path: Path, fleet_file: Path,
                                                                record: Callable[..., None]) -> None:
    server = EmbeddedServer(tmp_path / "data", port=free_port()).start()
    settings = Settings(nats_url=server.url, connect_timeout_s=2, request_timeout_s=2)
    node = load(fleet_file).node("l40s-01")
    agent_bus = await Bus.connect(settings, "outage-agent")
    bus = await Bus.connect(settings, "outage-liveness")
    monitor = HeartbeatMonitor(bus, timeout_s=TIMEOUT_S, check_every_s=0.1)
    try:
        await bus.ensure_streams()
        agent = Agent(agent_bus, SimNvml(node), node.name, simulated=True, heartbeat_s=0.1)
        async with running(agent):
            watching = asyncio.create_task(monitor.run())
            try:
                await until(lambda: node.name in monitor.heard, "the monitor hearing the agent")
                server.kill()
                await asyncio.sleep(TIMEOUT_S * 3)  # the node keeps beating; nobody can hear it
                server.start()
                back = m.utcnow()
                await until(lambda: monitor.heard[node.name].received > back, "a heartbeat after the outage", 20)
                await asyncio.sleep(TIMEOUT_S * 2)  # time enough to judge, were anything judged wrongly
                assert not watching.done(), watching
            finally:
                watching.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watching
        fleet = await stored(bus, subjects.STREAM_FLEET, limit_s=10)
    finally:
        await agent_bus.close()
        await bus.close()
        server.stop()
    lost = [e for e in fleet if isinstance(e, m.NodeLost | m.NodeReturned)]
    assert lost == [] and monitor.published == []
    record(outage_s=TIMEOUT_S * 3, timeout_s=TIMEOUT_S, node_lost=len(lost))
