"""A 3-node JetStream cluster with R3 streams: kill the stream leader, then two nodes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from faultkit import (
    caught_up,
    cluster_settings,
    health_event,
    node_last_seqs,
    stream_leader,
    wait_streams,
)

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus, RawMsg
from llmgw.bus.server import Cluster
from llmgw.errors import PublishError
from llmgw.fleet.state import fold

pytestmark = pytest.mark.slow
FLEET = subjects.STREAM_FLEET


async def read_all(bus: Bus, last: int) -> list[RawMsg]:
    out: list[RawMsg] = []
    async with asyncio.timeout(30):
        async for batch in bus.reader(FLEET, 1, stop_at=last).batches():
            out += batch
    return out


async def wait_in_sync(cluster: Cluster, want: int, limit_s: float = 30) -> dict[str, int]:
    """Until every running node holds ``want`` as its own last sequence."""
    seqs: dict[str, int] = {}
    async with asyncio.timeout(limit_s):
        while True:
            seqs = await asyncio.to_thread(node_last_seqs, cluster, FLEET)
            if len(seqs) == len(cluster.servers) and set(seqs.values()) == {want}:
                return seqs
            await asyncio.sleep(0.25)


async def test_stream_leader_sigkill_while_publishing_and_reading(cluster: Cluster, record: Callable[..., None]) -> None:
    n = 600
    settings = cluster_settings(cluster)
    admin = await Bus.connect(settings, "fault-admin")
    pub = await Bus.connect(settings, "fault-publisher")
    rd = await Bus.connect(settings, "fault-reader")
    seen: list[RawMsg] = []
    done_reading = asyncio.Event()
    reader = pub_task = None
    try:
        await wait_streams(admin, 3)
        outbox = pub.outbox()
        pub_task = asyncio.create_task(outbox.run())

        async def follow() -> None:
            async for batch in rd.reader(FLEET, 1, batch=64, idle_expires_s=1.0).batches():
                seen.extend(batch)
                if len(seen) >= n:
                    done_reading.set()

        reader = asyncio.create_task(follow())
        leader = await stream_leader(admin, FLEET)
        victim = cluster.servers[int(leader.removeprefix("n"))]
        for i in range(n):
            outbox.put(health_event(i))
            if i == n // 3:
                victim.kill()  # SIGKILL the stream leader mid-stream
            await asyncio.sleep(0.002)
        await outbox.flush(60)
        new_leader = await stream_leader(admin, FLEET)
        await caught_up(done_reading, reader, 60)
        victim.start()
        seqs = await wait_in_sync(cluster, n)
        clean = await read_all(admin, n)
    finally:
        for t in (reader, pub_task):
            if t is not None:
                t.cancel()
        for b in (admin, pub, rd):
            await b.close()

    expected = [health_event(i) for i in range(n)]
    live_events = [m.decode_event(x.data) for x in seen]
    assert new_leader != leader
    assert [x.seq for x in seen] == list(range(1, n + 1))  # nothing lost, nothing doubled, in order
    assert live_events == expected
    assert [x.data for x in clean] == [x.data for x in seen]
    assert fold(live_events) == fold(m.decode_event(x.data) for x in clean)
    assert outbox.delivered == n and outbox.refused == 0
    record(published=n, stored=seqs, read_live=len(seen), replayed=len(clean),
           duplicates_dropped_by_server=outbox.duplicates, killed=leader, new_leader=new_leader)


async def test_two_nodes_down_refuses_then_delivers_exactly_once(cluster: Cluster, record: Callable[..., None]) -> None:
    settings = cluster_settings(cluster)
    admin = await Bus.connect(settings, "fault-admin")
    pub = await Bus.connect(settings, "fault-publisher")
    run = None
    try:
        await wait_streams(admin, 3)
        for i in range(10):
            await pub.publish(health_event(i))
        # Keep the node that serves neither client's connection alive? Any two will do: no quorum.
        down = cluster.servers[1:]
        for s in down:
            s.kill()
        event = health_event(10)
        with pytest.raises(PublishError, match="no acknowledgement"):
            await pub.publish(event, timeout=4)
        outbox = pub.outbox()
        outbox.put(event)  # the same event, so the same Nats-Msg-Id as the refused attempt
        run = asyncio.create_task(outbox.run())
        await asyncio.sleep(2)
        pending_during_outage = len(outbox)
        for s in down:
            s.start()
        await outbox.flush(60)
        again = await pub.publish(event)  # a third try, after it is stored
        seqs = await wait_in_sync(cluster, 11)
        stored = await read_all(admin, 11)
    finally:
        if run is not None:
            run.cancel()
        for b in (admin, pub):
            await b.close()
    assert pending_during_outage == 1
    assert again.duplicate and again.seq == 11
    assert [m.decode_event(x.data) for x in stored] == [health_event(i) for i in range(11)]
    assert sum(x.data == m.encode(event) for x in stored) == 1
    record(published_attempts=3, stored=seqs, copies_of_event=1, duplicate_acks=int(again.duplicate) + outbox.duplicates)
