"""What a router's start costs to count every key's day (issue 45), never from a fold snapshot.

    python benchmarks/quota_start.py [--routers 3] [--tick 10] [--replicas 20] [--keys 5] [--rounds 3]

A whole day of maps is ``86,400 / tick`` per router: with three routers on the default 10 s tick,
25,920. This stores that many (each naming ``--replicas`` replicas and ``--keys`` keys, as a busy
router's map would), with each router's day totals every ``TOTALS_EVERY_S`` as routers publish
them, then times, alternated in one run: a router's start until its quotas have caught up (each
router's last totals, the maps after them and the last minute: ``llmgw/router/days.py``); reading
and counting every map of the day instead (what a start without the totals would have to do);
and a start on an empty usage stream.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import tempfile
import time
from pathlib import Path

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.bus.server import EmbeddedServer
from llmgw.config import Settings
from llmgw.router.days import TOTALS_EVERY_S
from llmgw.router.quotas import Quotas, utc_day
from llmgw.router.server import Router


def a_map(router: str, tick: int, replicas: int, keys: int) -> m.IdleMapPublished:
    now = m.utcnow()
    return m.IdleMapPublished(
        at=now, router=router, boot_id=f"{router}-b1", tick=tick,
        last_request={f"model-{i % 7}-r{i}": now for i in range(replicas)},
        callers={f"key-{k}": {f"model-{k % 7}": m.KeyUse(requests=3, prompt_tokens=300, completion_tokens=90)}
                 for k in range(keys)})


async def started(bus: Bus, name: str, expected: int = 0) -> float:
    t0 = time.perf_counter()
    r = Router(bus, name, tick_s=3600)
    await r.start("127.0.0.1", 0, wait_caught_up=600)
    took = time.perf_counter() - t0
    assert r.ticks.usage_caught_up.is_set()
    counts = r.quotas.counts.get("key-0")
    got = counts.tokens_today(utc_day(time.time())) if counts is not None else 0
    assert got == expected, f"{name} counted {got:,} tokens of key-0 today, not {expected:,}"
    await r.stop()
    return took


def a_day(args: argparse.Namespace) -> list[m.Event]:
    """Every router's maps of a day, each router's totals every TOTALS_EVERY_S among them."""
    out: list[m.Event] = []
    every = max(1, int(TOTALS_EVERY_S // args.tick))
    tokens = {r: 0 for r in range(args.routers)}
    for t in range(1, 86_400 // args.tick + 1):
        for r in range(args.routers):
            out.append(a_map(f"rt-{r}", t, args.replicas, args.keys))
            tokens[r] += 390
            if t % every == every // 2:  # the day ends between two: the maps after the last are read
                out.append(m.KeyDayTotals(at=m.utcnow(), router=f"rt-{r}", boot_id=f"rt-{r}-b1",
                                          day=utc_day(time.time()),
                                          tokens={f"key-{k}": tokens[r] for k in range(args.keys)}))
    return out


async def every_map(bus: Bus, name: str) -> float:
    """Read and count every map stored today: the start without day totals."""
    t0 = time.perf_counter()
    quotas, end = Quotas(name), await bus.stream_last_seq(subjects.STREAM_USAGE)
    follower = bus.follow(subjects.STREAM_USAGE, m.MAP_CALLERS_DECODER, 1, stop_at=end, who=name,
                          filter_subjects=(subjects.USAGE_IDLE_ALL,))
    async for batch in follower.batches():
        for d in batch:
            quotas.other_map(d.event)
        if follower.drained or follower.last_seq >= end:
            break
    return time.perf_counter() - t0


async def run(args: argparse.Namespace, empty: Bus, full: Bus) -> None:
    events = a_day(args)
    t0 = time.perf_counter()
    await full.publish_many(events)
    print(f"stored {len(events):,} maps and totals in {time.perf_counter() - t0:.1f} s "
          f"({len(m.encode(events[0])):,} bytes a map); waiting a minute, so that they are older than the "
          "requests-per-minute window, as a day's maps are")
    await asyncio.sleep(61)
    times: dict[str, list[float]] = {"empty usage stream": [], "start (totals + after)": [],
                                     "every map of the day": []}
    for i in range(args.rounds):
        times["empty usage stream"].append(await started(empty, f"rt-late-e{i}"))
        times["start (totals + after)"].append(await started(full, f"rt-late-f{i}",
                                                             390 * args.routers * (86_400 // args.tick)))
        times["every map of the day"].append(await every_map(full, f"rt-late-w{i}"))
    for what, ts in times.items():
        print(f"{what:>24}: median {statistics.median(ts):.2f} s "
              f"({', '.join(f'{t:.2f}' for t in ts)})")
    print(f"peak RSS of this process (routers in it): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routers", type=int, default=3)
    ap.add_argument("--tick", type=int, default=10, help="the routers' tick, seconds (maps a day = 86,400 / tick)")
    ap.add_argument("--replicas", type=int, default=20)
    ap.add_argument("--keys", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-quota-start-"))
    servers = [EmbeddedServer(tmp / name, port=0).start() for name in ("empty", "full")]
    try:
        async with await Bus.connect(Settings(nats_url=servers[0].url), "bench-empty") as empty, \
                await Bus.connect(Settings(nats_url=servers[1].url), "bench-full") as full:
            for bus in (empty, full):
                await bus.ensure_streams()
            await run(args, empty, full)
            print(f"usage stream: {await full.stream_last_seq(subjects.STREAM_USAGE):,} messages")
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    asyncio.run(main())
