"""What a test needs of the streams: an empty history, and every event stored so far."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import nats.js.errors  # the tests talk to the real server; in llmgw only bus.py imports nats

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.errors import BusError


async def fresh_streams(bus: Bus) -> None:
    """Delete llmgw's streams, the scheduler lease and the fold snapshots, then declare the streams again.

    A stream deleted and declared again within milliseconds can come back holding its old messages
    (seen under load with two test workers: a test's heartbeat stream at sequence 8 with the last
    test's agent's beats in it), so each is checked empty, and the whole is done again if one is not.
    """
    for attempt in range(25):
        await _delete_all(bus)
        try:
            await bus.ensure_streams(lease_ttl_s=1.0)  # the scheduler tests' leases: a dead leader's passes at once
        except BusError as e:
            # nats-server may still be removing the deleted stream's files: "error creating
            # store for stream (code 10049)" for a moment. Operators never delete and
            # re-create a stream within milliseconds; the tests do it before every test.
            if "10049" not in str(e) or attempt == 24:
                raise
            await asyncio.sleep(0.2)
            continue
        held = [spec.name for spec in subjects.STREAMS if await bus.stream_last_seq(spec.name)]
        if not held:
            return
        if attempt == 24:
            raise AssertionError(f"streams not empty after being deleted and declared again: {held}")
        await asyncio.sleep(0.2)


async def _delete_all(bus: Bus) -> None:
    for spec in subjects.STREAMS:
        try:
            await bus.js.delete_stream(spec.name)
        except nats.js.errors.NotFoundError:
            pass
    try:
        await bus.js.delete_key_value(subjects.SCHEDULER_LEASE_BUCKET)
    except nats.js.errors.NotFoundError:
        pass
    try:
        await bus.js.delete_object_store(subjects.SNAPSHOT_BUCKET)
    except nats.js.errors.NotFoundError:
        pass


async def stored(bus: Bus, stream: str, limit_s: float = 30.0) -> list[m.AnyEvent]:
    """Every event a stream holds now, decoded, in order (bounded in time)."""
    last = await bus.stream_last_seq(stream)
    out: list[m.AnyEvent] = []
    if last:
        async with asyncio.timeout(limit_s):
            async for batch in bus.reader(stream, 1, stop_at=last).batches():
                out.extend(m.decode_event(r.data) for r in batch)
    return out


async def engine_keys(bus: Bus) -> list[m.EngineKeyIssued]:
    """The engines' API keys the agents published, oldest first (their stream keeps each engine's latest)."""
    last = await bus.stream_last_seq(subjects.STREAM_ENGINE_KEYS)
    out: list[m.EngineKeyIssued] = []
    if last:
        async with asyncio.timeout(30):
            async for batch in bus.reader(subjects.STREAM_ENGINE_KEYS, 1, stop_at=last).batches():
                out.extend(m.ENGINE_KEY_DECODER.decode(r.data) for r in batch)
    return out


async def publish(bus: Bus, events: Sequence[m.Event | bytes]) -> dict[str, int]:
    """Publish events (bytes go to the fleet stream raw); the last sequence per stream."""
    last: dict[str, int] = {}
    for i, e in enumerate(events):
        if isinstance(e, bytes):
            ack = await bus.publish_bytes(subjects.fleet("n1", "inventory"), e, f"bad-{i}")
        else:
            ack = await bus.publish(e)
        last[ack.stream] = max(last.get(ack.stream, 0), ack.seq)
    return last
