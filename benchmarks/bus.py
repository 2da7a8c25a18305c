"""Publish and consume rates through llmgw's bus, next to raw nats-py in the same run.

    python benchmarks/bus.py [--events 200000] [--rounds 3]

Starts its own nats-server (from the wheel) in a temporary directory. Prints
medians over the rounds; the figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import nats

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.bus.server import EmbeddedServer
from llmgw.config import Settings

T0 = datetime(2026, 11, 1, tzinfo=UTC)


def events(n: int, offset: int = 0) -> list[m.Event]:
    return [
        m.IdleMapPublished(
            at=T0 + timedelta(seconds=i), router="r1", boot_id=f"b{offset}", tick=i,
            last_request={f"r-{i % 7}": T0},
        )
        for i in range(n)
    ]


async def rate(n: int, fn: Callable[[], Awaitable[None]]) -> float:
    t = time.perf_counter()
    await fn()
    return n / (time.perf_counter() - t)


async def round_(bus: Bus, url: str, n_seq: int, n_bulk: int) -> dict[str, float]:
    out: dict[str, float] = {}
    await bus.js.purge_stream(subjects.STREAM_USAGE)
    raw = await nats.connect(url)
    rjs = raw.jetstream()
    subj = subjects.usage_idle("r1")

    evs = events(n_seq, offset=time.time_ns())
    payloads = [(m.encode(e), subjects.msg_id(e, m.encode(e))) for e in evs]

    async def raw_seq() -> None:
        for p, mid in payloads:
            await rjs.publish(subj, p, headers={"Nats-Msg-Id": "raw" + mid})

    async def bus_seq() -> None:
        for e in evs:
            await bus.publish(e)

    out["publish, one at a time: raw js.publish"] = await rate(n_seq, raw_seq)
    out["publish, one at a time: Bus.publish"] = await rate(n_seq, bus_seq)

    outbox = bus.outbox(maxlen=n_seq + 1)
    runner = asyncio.create_task(outbox.run())
    evs2 = events(n_seq, offset=time.time_ns() + 10**9)

    async def via_outbox() -> None:
        for e in evs2:
            outbox.put(e)
        await outbox.flush(timeout=600)

    out["publish, one at a time: Outbox (ordered, exactly once)"] = await rate(n_seq, via_outbox)
    runner.cancel()

    bulk = events(n_bulk, offset=time.time_ns() + 2 * 10**9)
    bulk_payloads = [(m.encode(e), subjects.msg_id(e, m.encode(e))) for e in bulk]

    async def raw_async() -> None:
        for i in range(0, n_bulk, 2048):
            futs = [await rjs.publish_async(subj, p, headers={"Nats-Msg-Id": "raw" + mid}) for p, mid in bulk_payloads[i : i + 2048]]
            await asyncio.gather(*futs)

    async def bus_many() -> None:
        await bus.publish_many(bulk)

    out["publish, pipelined: raw js.publish_async"] = await rate(n_bulk, raw_async)
    await bus.js.purge_stream(subjects.STREAM_USAGE)
    out["publish, pipelined: Bus.publish_many"] = await rate(n_bulk, bus_many)

    last = await bus.stream_last_seq(subjects.STREAM_USAGE)
    first = last - n_bulk + 1

    async def read_bus() -> None:
        n = 0
        async for b in bus.reader(subjects.STREAM_USAGE, first, stop_at=last).batches():
            n += len(b)
        assert n == n_bulk, n

    async def read_fetch() -> None:
        psub = await rjs.pull_subscribe(subj, durable=None, config=nats.js.api.ConsumerConfig(
            deliver_policy=nats.js.api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=first,
            ack_policy=nats.js.api.AckPolicy.NONE))
        n = 0
        while n < n_bulk:
            msgs = await psub.fetch(min(1024, n_bulk - n), timeout=5)
            n += len(msgs)
        await psub.unsubscribe()

    async def read_ordered() -> None:
        n = 0
        done = asyncio.Event()

        async def cb(msg: nats.aio.msg.Msg) -> None:
            nonlocal n
            n += 1
            if n >= n_bulk:
                done.set()

        sub = await rjs.subscribe(subj, ordered_consumer=True, cb=cb,
                                  deliver_policy=nats.js.api.DeliverPolicy.BY_START_SEQUENCE,
                                  config=nats.js.api.ConsumerConfig(opt_start_seq=first))
        await asyncio.wait_for(done.wait(), timeout=600)
        await sub.unsubscribe()

    out["consume: raw nats-py pull fetch(1024)"] = await rate(n_bulk, read_fetch)
    out["consume: raw nats-py ordered push consumer"] = await rate(n_bulk, read_ordered)
    out["consume: Bus.reader (client-driven pull loop)"] = await rate(n_bulk, read_bus)
    await raw.close()
    return out


async def main(n_bulk: int, rounds: int) -> None:
    store = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    server = EmbeddedServer(store, port=0).start()
    try:
        bus = await Bus.connect(Settings(nats_url=server.url), "bench")
        await bus.ensure_streams()
        results: dict[str, list[float]] = {}
        for r in range(rounds):
            for k, v in (await round_(bus, server.url, max(2000, n_bulk // 20), n_bulk)).items():
                results.setdefault(k, []).append(v)
            print(f"round {r + 1}/{rounds} done", flush=True)
        await bus.close()
    finally:
        server.stop()
    print(f"\n{'path':58} {'median msgs/s':>14}   rounds")
    for k, vs in results.items():
        print(f"{k:58} {statistics.median(vs):>14,.0f}   {', '.join(f'{v:,.0f}' for v in vs)}")
    med = {k: statistics.median(v) for k, v in results.items()}
    print("\nratios (same run):")
    print(f"  Bus.publish / raw js.publish          {med['publish, one at a time: Bus.publish'] / med['publish, one at a time: raw js.publish']:.2f}")
    print(f"  Bus.publish_many / raw publish_async  {med['publish, pipelined: Bus.publish_many'] / med['publish, pipelined: raw js.publish_async']:.2f}")
    print(f"  Bus.reader / raw fetch()              {med['consume: Bus.reader (client-driven pull loop)'] / med['consume: raw nats-py pull fetch(1024)']:.2f}")
    print(f"  Bus.reader / raw ordered consumer     {med['consume: Bus.reader (client-driven pull loop)'] / med['consume: raw nats-py ordered push consumer']:.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    try:
        import uvloop

        uvloop.run(main(a.events, a.rounds))
    except ImportError:
        asyncio.run(main(a.events, a.rounds))
