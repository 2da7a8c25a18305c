"""What-if benchmark: ``ctl what-if`` against ``ctl status --replay --no-snapshot`` on the same stored history.

Two histories, one after the other, on an embedded nats-server:

* the replay benchmark's busy week (benchmarks/replay.py: 1M events of random churn, not
  made by a scheduler, so the recorded policy cannot reproduce it: its fidelity is low by
  construction and the figure here is the cost);
* a history the real scheduler made in virtual time (tests/whatif_world.py): wakes,
  idle stops, scale-ups; here fidelity means something.

Each command runs as its own process (the CLI a user runs), timed, with its peak RSS.

    .venv/bin/python benchmarks/whatif.py                      # 1M-event week, a 1-day world, 3 runs each
    .venv/bin/python benchmarks/whatif.py --events 200000 --runs 1

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from replay import fresh, publish  # noqa: E402
from replay import history as churn  # noqa: E402
from whatif_world import history as world  # noqa: E402
from whatif_world import spec  # noqa: E402

from llmgw import messages as m  # noqa: E402
from llmgw import subjects  # noqa: E402
from llmgw.bus import Bus  # noqa: E402
from llmgw.bus.server import EmbeddedServer  # noqa: E402
from llmgw.config import Settings  # noqa: E402
from llmgw.ctl import first_stored  # noqa: E402

LLMGW = str(Path(sys.executable).with_name("llmgw"))


def timed_rss(*args: str) -> tuple[float, float, str]:
    """Seconds, peak RSS in MiB (what the kernel kept for the child: os.wait4) and stdout of one ``llmgw`` process."""
    start = time.perf_counter()
    proc = subprocess.Popen([LLMGW, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    secs = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"llmgw {' '.join(args)} failed ({proc.returncode})")
    return secs, usage.ru_maxrss / 1024, out


async def settle(bus: Bus) -> int:
    sizes = {s: await bus.stream_last_seq(s) for s in subjects.HISTORY_STREAMS}
    while True:  # JetStream may still be storing what the flushes handed it
        await asyncio.sleep(1.0)
        now = {s: await bus.stream_last_seq(s) for s in subjects.HISTORY_STREAMS}
        if now == sizes:
            return sum(now.values())
        sizes = now


def world_events(days: float, seed: int = 11) -> list[m.Event]:
    """Eight models on four 8-GPU nodes: fixed ones with idle TTLs, autoscaled ones, requests in bursts."""
    rng = random.Random(seed)
    specs = [spec("chat", ttl=900.0), spec("code", ttl=1800.0, tp=2), spec("embed", ttl=600.0),
             spec("rare", ttl=300.0), spec("batch", lo=0, hi=4, target=2.0), spec("agent", lo=0, hi=3, target=1.0),
             spec("big", tp=4), spec("steady")]
    end = days * 86400
    requests: list[tuple[float, str]] = []
    for s in specs:
        t = rng.uniform(0, 3600)
        busy = {"batch": 0.3, "agent": 0.5}.get(s.name, 20.0)
        while t < end:
            burst = rng.expovariate(1 / 600)
            stop = t + burst
            while t < stop and t < end:
                requests.append((t, s.name))
                t += rng.expovariate(1 / busy)
            t += rng.expovariate(1 / ({"rare": 14_400, "steady": 60}.get(s.name, 3600)))
    requests.sort()
    return [e for _, e in world(specs, requests, hours=days * 24, nodes=4, gpus=8)]


def measure(url: str, since: str, runs: int, label: str) -> None:
    status, what, sweep = [], [], []
    report: dict[str, object] = {}
    for _ in range(runs):
        status.append(timed_rss("ctl", "status", "--replay", "--no-snapshot", "--json", "--nats-url", url)[:2])
        secs, rss, out = timed_rss("ctl", "what-if", "--since", since, "--idle-ttl", "15m", "--no-snapshot", "--json",
                                   "--nats-url", url)
        what.append((secs, rss))
        report = json.loads(out)
        secs, rss, _ = timed_rss("ctl", "what-if", "--since", since, "--idle-ttl", "5m,15m,1h,never", "--no-snapshot",
                                 "--json", "--nats-url", url)
        sweep.append((secs, rss))

    def med(xs: list[tuple[float, float]]) -> str:
        return (f"{statistics.median(x for x, _ in xs):.1f} s (runs: {', '.join(f'{x:.1f}' for x, _ in xs)}), "
                f"peak {max(r for _, r in xs):.0f} MiB")

    s = statistics.median(x for x, _ in status)
    w = statistics.median(x for x, _ in what)
    sw = statistics.median(x for x, _ in sweep)
    fid = report["fidelity"]
    print(f"{label}: {report['events']:,} events in the window")
    print(f"  ctl status --replay --no-snapshot   {med(status)}")
    print(f"  ctl what-if --idle-ttl 15m          {med(what)}  = {w / s:.2f}x status")
    print(f"  ctl what-if sweep of 4 TTLs         {med(sweep)}  = {sw / w:.2f}x one what-if")
    print(f"  fidelity: {fid['reproduced']:.1%} of {fid['recorded_decisions']:,} placements and stops reproduced, "  # type: ignore[index]
          f"GPU-hours {fid['gpu_hours_replayed']:,.1f} replayed vs {fid['gpu_hours_recorded']:,.1f} recorded")  # type: ignore[index]
    for a in [report["recorded"], *report["asked"]]:  # type: ignore[list-item]
        print(f"  {a['policy']:>16}: {json.dumps(a['total'])}")  # type: ignore[index]


async def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-whatif-", dir=args.workdir))
    server = EmbeddedServer(work / "nats", port=0)
    server.start()
    settings = Settings(nats_url=server.url, request_timeout_s=30.0)
    try:
        bus = await Bus.connect(settings, "llmgw-bench")
        if args.events:
            await fresh(bus)
            n, secs = await publish(bus, churn(args.events, 256, 8, 7, 2, 10.0, 48, 6), 10_000)
            stored = await settle(bus)
            print(f"replay benchmark's week: published {n:,} events in {secs:.0f}s, stored {stored:,}")
            first = await first_stored(bus)
            assert first is not None
            measure(server.url, first.isoformat(), args.runs, "the replay benchmark's week (random churn)")
        if args.world_days:
            t = time.perf_counter()
            events = world_events(args.world_days)
            print(f"scheduler-made history: {len(events):,} events for {args.world_days:g} days generated in "
                  f"{time.perf_counter() - t:.0f}s")
            await fresh(bus)
            # Each publish acked before the next: the streams then store the history in its own order
            # across them (a burst of core publishes is stored in no order across streams, and a
            # replay merges them by stored time).
            t = time.perf_counter()
            for event in events:
                await bus.publish(event)
            print(f"published in {time.perf_counter() - t:.0f}s")
            first = await first_stored(bus)
            assert first is not None
            measure(server.url, first.isoformat(), args.runs, f"a {args.world_days:g}-day history the scheduler made")
        await bus.close()
    finally:
        server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=1_000_000, help="the replay benchmark's week (0: skip it)")
    p.add_argument("--world-days", type=float, default=1.0, help="days of the scheduler-made history (0: skip it)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--workdir")
    asyncio.run(main(p.parse_args()))
