"""The bus against a real nats-server: idempotent publish, ordered reads, an outbox that survives an outage."""

from __future__ import annotations

import asyncio
import functools
import socket
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from running import until

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus, RawMsg, windows
from llmgw.bus.reader import StreamReader
from llmgw.bus.server import EmbeddedServer
from llmgw.config import Settings
from llmgw.errors import ConnectError, ServiceError

T0 = datetime(2026, 11, 1, 10, 0, tzinfo=UTC)


def lost(i: int, node: str = "n1") -> m.NodeLost:
    return m.NodeLost(at=T0 + timedelta(seconds=i), node=node)


async def test_streams_are_declared_and_redeclaring_changes_nothing(bus: Bus) -> None:
    before = {s.name: (await bus.js.stream_info(s.name)).config for s in subjects.STREAMS}
    await bus.ensure_streams()
    for spec in subjects.STREAMS:
        info = await bus.js.stream_info(spec.name)
        assert info.config == before[spec.name]
        assert info.config.subjects == list(spec.subjects)
        assert info.config.duplicate_window == spec.duplicate_window_s
    hb = await bus.js.stream_info(subjects.STREAM_HEARTBEAT)
    assert hb.config.max_msgs_per_subject == 1


async def test_publishing_the_same_event_twice_stores_it_once(bus: Bus) -> None:
    event = lost(1)
    first = await bus.publish(event)
    second = await bus.publish(event)
    assert (first.seq, first.duplicate) == (1, False)
    assert (second.seq, second.duplicate) == (1, True)
    await bus.publish(lost(2))
    assert await bus.stream_last_seq(subjects.STREAM_FLEET) == 2


async def test_reader_reads_in_order_from_a_sequence_and_stops(bus: Bus) -> None:
    for i in range(1, 501):
        await bus.publish(lost(i, node=f"n{i % 3}"))
    got = [msg async for batch in bus.reader(subjects.STREAM_FLEET, 101, batch=64, stop_at=500).batches() for msg in batch]
    assert [x.seq for x in got] == list(range(101, 501))
    first = m.decode_event(got[0].data)
    assert isinstance(first, m.NodeLost) and first.at == T0 + timedelta(seconds=101)
    only_n1 = [
        msg
        async for batch in bus.reader(subjects.STREAM_FLEET, 1, stop_at=500, filter_subjects=[subjects.fleet("n1", "lost")]).batches()
        for msg in batch
    ]
    assert {x.subject for x in only_n1} == {"llmgw.fleet.n1.lost"}
    assert len(only_n1) == len([i for i in range(1, 501) if i % 3 == 1])


async def test_reader_follows_new_events_live(bus: Bus) -> None:
    seen: list[int] = []

    async def follow() -> None:
        async for batch in bus.reader(subjects.STREAM_FLEET, 1, idle_expires_s=0.5).batches():
            seen.extend(x.seq for x in batch)
            if len(seen) >= 30:
                return

    task = asyncio.create_task(follow())
    for i in range(30):
        await bus.publish(lost(i))
        if i % 10 == 0:
            await asyncio.sleep(0.2)  # let the reader catch up and wait between bursts
    await asyncio.wait_for(task, timeout=15)
    assert seen == list(range(1, 31))


async def test_a_follower_cancelled_as_a_message_wakes_it_stops(bus: Bus) -> None:
    """Python 3.11's ``wait_for`` returns the inner result and drops a cancel that lands in the
    same loop turn (gh-86296): a follower cancelled just as it woke then ran on, and the
    scheduler that cancelled it waited forever (the poison fault test, 1 run in 5 under load)."""
    async def follow(reader: StreamReader) -> None:
        async for _ in reader.batches():
            pass

    for _ in range(20):
        reader = bus.reader(subjects.STREAM_FLEET, 1, idle_expires_s=0.5)
        task = asyncio.create_task(follow(reader))
        await until(functools.partial(_waiting, reader), "the follower waiting")
        await asyncio.sleep(0.05)
        reader._wake.set()  # a message arrives ...
        task.cancel()  # ... in the same turn as the cancel
        done, _ = await asyncio.wait([task], timeout=5)
        assert done, "the follower swallowed its cancel and is still running"


def _waiting(reader: StreamReader) -> bool:
    return reader._sub is not None and not reader._wake.is_set()


async def test_empty_stream_and_start_past_the_end(bus: Bus) -> None:
    assert [b async for b in bus.reader(subjects.STREAM_CONTROL, 1, stop_at=0).batches()] == []
    await bus.publish(lost(1))
    assert [b async for b in bus.reader(subjects.STREAM_FLEET, 5, stop_at=1).batches()] == []


async def test_a_service_that_fails_answers_with_an_error_and_keeps_serving(bus: Bus) -> None:
    async def handler(data: bytes) -> bytes:
        if data == b"bad":
            raise ValueError("that request makes no sense: tp 3 for 64 heads")
        return b"ok:" + data

    sub = await bus.serve("llmgw.test.svc", handler)
    try:
        with pytest.raises(ServiceError, match="tp 3 for 64 heads"):
            await bus.request("llmgw.test.svc", b"bad", service="test service")
        assert await bus.request("llmgw.test.svc", b"x") == b"ok:x"
    finally:
        await sub.unsubscribe()
    with pytest.raises(ServiceError, match="no planner is running"):
        await bus.request("llmgw.test.nobody", b"", service="planner", timeout=2)


async def test_unreachable_server_is_one_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectError, match=r"cannot reach NATS at nats://127.0.0.1:\d+; start one with `llmgw nats`"):
        await Bus.connect(Settings(nats_url=f"nats://127.0.0.1:{port}", connect_timeout_s=1), "t", reconnect=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_outbox_delivers_every_event_exactly_once_across_a_server_restart(tmp_path: Path) -> None:
    """Kill the server mid-run (SIGKILL), keep publishing into the outbox, restart: all arrive once, in order."""
    port = _free_port()
    server = EmbeddedServer(tmp_path / "js", port=port).start()
    try:
        bus = await Bus.connect(Settings(nats_url=server.url, request_timeout_s=1), "outbox-test")
        await bus.ensure_streams()
        outbox = bus.outbox(maxlen=1000)
        runner = asyncio.create_task(outbox.run())
        events = [lost(i, node=f"n{i}") for i in range(60)]
        for e in events[:20]:
            outbox.put(e)
        await outbox.flush(timeout=10)
        server.kill()
        for e in events[20:40]:
            outbox.put(e)  # queued while the server is down
        await asyncio.sleep(1.0)
        server.start()
        for e in events[40:]:
            outbox.put(e)
        await outbox.flush(timeout=30)
        last = await bus.stream_last_seq(subjects.STREAM_FLEET)
        stored = [
            m.decode_event(x.data)
            async for batch in bus.reader(subjects.STREAM_FLEET, 1, stop_at=last).batches()
            for x in batch
        ]
        assert stored == events  # every event, once, in order
        assert outbox.delivered == 60
        runner.cancel()
        await bus.close()
    finally:
        server.stop()


class _Batches:
    """A stand-in for a StreamReader: its batches, as given."""

    def __init__(self, *batches: list[tuple[int, int]]) -> None:
        self._batches = [[RawMsg(seq=seq, subject="s", data=b"", ts_ns=ts) for seq, ts in b] for b in batches]

    async def batches(self) -> AsyncIterator[list[RawMsg]]:
        for b in self._batches:
            yield b


async def test_windows_merge_streams_by_stored_time_even_when_a_clock_steps_back() -> None:
    # b's second message was stored "before" its first (a server clock stepped back): it must come out
    # after it, in stream order, and the merge must not stop making progress (it looped for ever).
    readers = {"a": _Batches([(1, 10), (2, 30)], [(3, 60)]), "b": _Batches([(1, 20), (2, 15)], [(3, 50)])}
    out = []
    async with asyncio.timeout(5):
        async for window in windows(readers):  # type: ignore[arg-type]
            assert window, "an empty window makes no progress"
            out.extend((stream, [x.seq for x in run]) for stream, run in window)
    seen = {s: [seq for stream, run in out if stream == s for seq in run] for s in readers}
    assert seen == {"a": [1, 2, 3], "b": [1, 2, 3]}
    # Nothing stored later comes before anything stored earlier (by each stream's time so far).
    order = [(stream, seq) for stream, run in out for seq in run]
    assert order.index(("b", 2)) < order.index(("a", 2)) and order.index(("b", 3)) < order.index(("a", 3))
