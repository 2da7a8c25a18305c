"""One nats-server restarted (SIGTERM and SIGKILL) under a running publisher and reader."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from faultkit import caught_up, health_event

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus, RawMsg
from llmgw.bus.server import EmbeddedServer, free_port
from llmgw.config import Settings

pytestmark = pytest.mark.slow
FLEET = subjects.STREAM_FLEET
# What nats.conf ships: fsync before every ack.
DURABLE_CONF = "jetstream {\n  sync_interval: always\n}\n"


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
async def test_server_restart_under_publisher_and_reader(tmp_path: Path, how: str, record: Callable[..., None]) -> None:
    n = 500
    conf = tmp_path / "nats.conf"
    conf.write_text(DURABLE_CONF)
    server = EmbeddedServer(tmp_path / "data", port=free_port(), config_file=conf).start()
    settings = Settings(nats_url=server.url, connect_timeout_s=2, request_timeout_s=2)
    pub = await Bus.connect(settings, "fault-publisher")
    rd = await Bus.connect(settings, "fault-reader")
    seen: list[RawMsg] = []
    done_reading = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    try:
        await pub.ensure_streams()
        outbox = pub.outbox()
        tasks.append(asyncio.create_task(outbox.run()))

        reader = rd.reader(FLEET, 1, batch=64, idle_expires_s=1.0)

        async def follow() -> None:
            async for batch in reader.batches():
                seen.extend(batch)
                if len(seen) >= n:
                    done_reading.set()

        reader_task = asyncio.create_task(follow())
        tasks.append(reader_task)
        for i in range(n):
            outbox.put(health_event(i))
            if i == n // 3:
                server.stop() if how == "sigterm" else server.kill()
            if i == 2 * n // 3:  # the publisher kept queueing while the server was down
                queued_while_down = len(outbox)
                server.start()
            await asyncio.sleep(0.003)
        await outbox.flush(60)
        await caught_up(done_reading, reader_task, 60)
        stored = await pub.stream_last_seq(FLEET)
    finally:
        for t in tasks:
            t.cancel()
        for b in (pub, rd):
            await b.close()
        server.stop()
    assert queued_while_down > 0
    assert stored == n
    assert [x.seq for x in seen] == list(range(1, n + 1))
    assert [m.decode_event(x.data) for x in seen] == [health_event(i) for i in range(n)]
    record(how=how, published=n, stored=stored, read=len(seen), queued_at_restart=queued_while_down,
           duplicates_dropped_by_server=outbox.duplicates, reader_consumer_recreated=reader.resets)
