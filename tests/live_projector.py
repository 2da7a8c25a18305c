"""A projector serving status from its own thread and loop, for CLI tests that ask it over NATS."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from streams import fresh_streams

from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.config import Settings
from llmgw.projections.runner import Projector
from llmgw.projections.store import Store


async def publish_fresh(settings: Settings, events: Sequence[m.Event]) -> None:
    """Empty the streams, then publish ``events`` in order."""
    bus = await Bus.connect(settings, "llmgw-test-cli")
    try:
        await fresh_streams(bus)
        for event in events:
            await bus.publish(event)
    finally:
        await bus.close()


@contextlib.contextmanager
def serving(settings: Settings, db: Path, expected: int, *, commit_interval_s: float = 0.05,
            writer_process: bool = False) -> Iterator[Projector]:
    """Run a projector on ``db`` until the block ends, once it has folded ``expected`` events."""
    ready = threading.Event()
    stop: list[asyncio.AbstractEventLoop | asyncio.Task[None]] = []
    holder: list[Projector] = []

    async def main() -> None:
        bus = await Bus.connect(settings, "llmgw-test-projector")
        store = Store(db)
        projector = Projector(bus, store, commit_interval_s=commit_interval_s, writer_process=writer_process)
        holder.append(projector)
        task = asyncio.create_task(projector.run_forever())
        stop.extend([asyncio.get_running_loop(), task])
        for _ in range(400):  # bounded: 20 s
            if sum(projector.cursor.positions.values()) >= expected:
                break
            await asyncio.sleep(0.05)
        ready.set()
        try:
            await task
        except asyncio.CancelledError:
            pass
        finally:
            store.close()
            await bus.close()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert ready.wait(timeout=30)
    try:
        yield holder[0]
    finally:
        loop, task = stop
        assert isinstance(loop, asyncio.AbstractEventLoop) and isinstance(task, asyncio.Task)
        loop.call_soon_threadsafe(task.cancel)
        thread.join(timeout=15)
        assert not thread.is_alive()
