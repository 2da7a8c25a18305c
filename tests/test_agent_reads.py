"""What an agent reads of the control stream: only what concerns a node's engines and files.

At 300 nodes an agent that read every key and every node's state reports cost nats-server 300
copies of each (issue 45, finding 5); the server now delivers an agent only models, placements
and stops (``subjects.agent_control``), and a worker part its head's state reports.
"""

from __future__ import annotations

import asyncio
import json

from test_engines import placed, spec

from llmgw import messages as m
from llmgw import subjects
from llmgw.agent.runs import EngineConfig
from llmgw.agent.supervisor import EngineSupervisor
from llmgw.bus import Bus

KEYS = 300


def key(i: int) -> m.KeyDeclared:
    return m.KeyDeclared(at=m.utcnow(), name=f"k{i}", lookup_id=f"{i:016x}", salt="ab" * 16, digest="cd" * 32)


async def consumers(bus: Bus) -> list[dict[str, object]]:
    """Every consumer of the control stream, as nats-server describes it."""
    reply = await bus.nc.request(subjects.js_api("CONSUMER.LIST", subjects.STREAM_CONTROL), b"{}", timeout=5)
    return list(json.loads(reply.data)["consumers"])


async def test_an_agent_is_sent_no_key_and_no_other_nodes_state_and_still_catches_up(bus: Bus) -> None:
    s = spec(tp=1)
    there = placed("qwen-r9", node="n9", s=s)
    events: list[m.Event] = [m.ModelDeclared(at=m.utcnow(), spec=s), there]
    events += [key(i) for i in range(KEYS)]
    events += [m.ReplicaStateChanged(at=m.utcnow(), replica_id="qwen-r9", model="qwen", node="n9", state="starting",
                                     detail=f"loading {i}") for i in range(50)]
    await bus.publish_many(events)  # the stream's last message is a state report n1's agent never sees

    sup = EngineSupervisor("n1", EngineConfig())
    task = asyncio.create_task(sup.run(bus, bus.outbox()))
    try:
        async with asyncio.timeout(10):
            await sup.caught_up.wait()  # drained, although its last sequence is never one it reads
        mine = [c for c in await consumers(bus) if "engines on n1" in str(c["config"].get("description"))]  # type: ignore[union-attr]
        assert len(mine) == 1
        assert mine[0]["config"]["filter_subjects"] == list(subjects.agent_control())  # type: ignore[index]
        assert mine[0]["delivered"]["consumer_seq"] == 2  # type: ignore[index]  # the model and the placement
        assert sup.placed == {}  # placed on another node: nothing runs here
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_an_agent_on_a_stream_of_nothing_it_reads_is_caught_up(bus: Bus) -> None:
    await bus.publish_many([key(i) for i in range(20)])
    sup = EngineSupervisor("n1", EngineConfig())
    task = asyncio.create_task(sup.run(bus, bus.outbox()))
    try:
        async with asyncio.timeout(10):
            await sup.caught_up.wait()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
