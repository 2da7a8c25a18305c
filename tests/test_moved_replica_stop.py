"""The stop of a replica moved off a faulty GPU says why (issue 43: its agent reported "stopped on request").

Against a real nats-server, with a simulated engine under the agent's supervisor.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from running import until
from streams import stored

from llmgw import messages as m
from llmgw import subjects
from llmgw.agent.runs import EngineConfig
from llmgw.agent.supervisor import EngineSupervisor
from llmgw.bus import Bus

NODE = "n1"
WHY = "re-placing: GPU 0 (GPU-0) on n1 unhealthy: xid 79: GPU has fallen off the bus"


@pytest.fixture
async def supervisor(bus: Bus) -> AsyncIterator[EngineSupervisor]:
    outbox = bus.outbox()
    sup = EngineSupervisor(NODE, EngineConfig(simulate=True, fake_startup_s=0.1, health_timeout_s=30))
    tasks = [asyncio.create_task(outbox.run()), asyncio.create_task(sup.run(bus, outbox))]
    try:
        yield sup
    finally:
        for t in reversed(tasks):
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)


async def reports(bus: Bus) -> list[tuple[str, str]]:
    return [(e.state, e.detail) for e in await stored(bus, subjects.STREAM_CONTROL)
            if isinstance(e, m.ReplicaStateChanged) and e.replica_id == "a-r1"]


async def test_the_agents_stop_report_of_a_moved_replica_names_the_fault(bus: Bus, supervisor: EngineSupervisor) -> None:
    s = m.ModelSpec(name="a", source="/models/x.gguf", precision="q8_0", engine="llama.cpp", gpu_class="CPU-16GB",
                    context=512, tp=1, gib_per_gpu=1.0)
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=s))
    await bus.publish(m.ReplicaPlaced(at=m.utcnow(), replica_id="a-r1", model="a", nodes=(NODE,), spec=s,
                                      gpus=(m.GpuRef(node=NODE, index=0, uuid="GPU-0", mib=1024),), fabric="local"))

    async def healthy() -> bool:
        return ("healthy", "") in await reports(bus)

    await until(healthy, "a-r1 healthy", limit_s=30)
    await bus.publish(m.ReplicaStopped(at=m.utcnow(), replica_id="a-r1", model="a", reason=WHY, code="gpu_unhealthy"))

    async def stopped() -> bool:
        return any(state == "stopped" for state, _ in await reports(bus))

    await until(stopped, "a-r1's stop reported", limit_s=30)
    (detail,) = [d for state, d in await reports(bus) if state == "stopped"]
    assert detail != "stopped on request" and WHY in detail, detail
