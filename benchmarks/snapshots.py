"""Time travel on a long history: ``ctl status --at`` with fold snapshots and without.

Publishes the replay benchmark's week (a 256-node fleet, 1M events by default),
projects it once with fold snapshots on (every ``--every`` events), then runs
``llmgw ctl status --json`` as a user would (a new process each time) at 10%,
50% and 90% of the history's stored-time range and with ``--replay``, each with
snapshots and with ``--no-snapshot`` beside it, printing wall time and the
child's peak RSS. Then the projector's own cost of writing snapshots: from zero,
alternating with and without, ``--rounds`` times each.

    .venv/bin/python benchmarks/snapshots.py                  # 1M events
    .venv/bin/python benchmarks/snapshots.py --events 200000  # quicker
    .venv/bin/python benchmarks/snapshots.py --store /tmp/week # keep the week there; a second run reuses it
    .venv/bin/python benchmarks/snapshots.py --store /tmp/week --rebuild --parts ctl   # time travel after a rebuild

Prints figures; asserts nothing (timing belongs here, not in tests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay import history, publish  # noqa: E402 - the replay benchmark's week, published the same way

from llmgw import subjects  # noqa: E402
from llmgw.bus import Bus  # noqa: E402
from llmgw.bus.server import EmbeddedServer  # noqa: E402
from llmgw.config import Settings  # noqa: E402
from llmgw.fleet import snapshots  # noqa: E402
from llmgw.projections.runner import Projector  # noqa: E402
from llmgw.projections.store import Store  # noqa: E402

LLMGW = str(Path(sys.executable).with_name("llmgw"))


# The child is forked from this small launcher, not from the benchmark: a fork of a process
# holding a week of generated events starts with its pages, and the kernel keeps the larger of
# the pre- and post-exec peaks as the child's ru_maxrss (hundreds of MiB that llmgw never used).
_LAUNCH = """
import os, sys, time
start = time.perf_counter()
out = int(sys.argv.pop(1))
pid = os.fork()
if pid == 0:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
os.write(out, f"{time.perf_counter() - start} {usage.ru_maxrss} {os.waitstatus_to_exitcode(status)}".encode())
"""


def run_cli(*args: str) -> tuple[float, float, str]:
    """One ``llmgw`` process: wall seconds, peak RSS (MiB), stderr."""
    r, w = os.pipe()
    proc = subprocess.run([sys.executable, "-c", _LAUNCH, str(w), LLMGW, *args], pass_fds=(w,),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    os.close(w)
    wall, rss, code = os.read(r, 256).decode().split()
    os.close(r)
    err = proc.stderr.decode(errors="replace")
    if int(code) or proc.returncode:
        raise SystemExit(f"llmgw {' '.join(args)} failed: {err}")
    return float(wall), int(rss) / 1024, err


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)


async def project(bus: Bus, path: Path, every: int | None, *, fresh: bool = True) -> tuple[float, int, int]:
    """Project (from zero when ``fresh``): seconds, events folded, snapshots written."""
    if fresh:
        _remove(path)
    store = Store(path)
    start = time.perf_counter()
    # The cadence ``llmgw project`` writes fold snapshots at (every so many events or so long).
    projector = Projector(bus, store, writer_process=True, fold_snapshot_events=every,
                          fold_snapshot_interval_s=snapshots.DEFAULT_INTERVAL_S)
    await projector.run_once()
    secs = time.perf_counter() - start
    store.close()
    return secs, projector.folded, projector.fold_snapshots_written


async def stored_range(bus: Bus) -> tuple[int, int]:
    """The first and last stored times (ns) over the history streams."""
    lo, hi = None, 0
    for stream in subjects.HISTORY_STREAMS:
        last = await bus.stream_last_seq(stream)
        for seq in (1, last):
            async for batch in bus.reader(stream, seq, batch=1, stop_at=seq).batches():
                ts = batch[0].ts_ns
                lo = ts if lo is None else min(lo, ts)
                hi = max(hi, ts)
                break
    assert lo is not None
    return lo, hi


async def main(args: argparse.Namespace) -> None:
    work = Path(args.store) if args.store else Path(tempfile.mkdtemp(prefix="llmgw-bench-snap-", dir=args.workdir))
    reuse = args.store is not None and (work / "nats").exists()
    server = EmbeddedServer(work / "nats", port=0)
    server.start()
    url = server.url
    try:
        bus = await Bus.connect(Settings(nats_url=url, request_timeout_s=30.0), "llmgw-bench")
        await bus.ensure_streams()
        if not reuse:
            await publish_and_project(bus, work, args)
        if args.rebuild:
            await rebuild(bus, work, args)
        await measure(bus, url, work, args)
        await bus.close()
    finally:
        server.stop()
        if args.store is None:
            shutil.rmtree(work, ignore_errors=True)


async def publish_and_project(bus: Bus, work: Path, args: argparse.Namespace) -> None:
    # As a fleet lives: the history arrives in chunks and a live projector folds each as it comes,
    # so each snapshot is taken at the streams' heads (every stream at one moment), as in production.
    gen = iter(history(args.events, 256, 8, 7, 2, 10.0, 48, 6))
    n = written = 0
    live = work / "live.duckdb"
    pub_s = proj_s = 0.0
    while True:
        chunk = list(itertools.islice(gen, args.every))
        if not chunk:
            break
        k, secs = await publish(bus, iter(chunk), 10_000)
        n, pub_s = n + k, pub_s + secs
        await asyncio.sleep(0.5)
        # Due a little before the chunk's end: the server drops the week's few duplicate msg ids.
        secs, _, w = await project(bus, live, args.every * 9 // 10, fresh=False)
        written, proj_s = written + w, proj_s + secs
    print(f"published {n:,} events in {pub_s:.1f}s, projected as they came in {proj_s:.1f}s; "
          f"{written} fold snapshots written (one every {args.every:,} events)")


async def rebuild(bus: Bus, work: Path, args: argparse.Namespace) -> None:
    """As after a lost DuckDB file or a FOLD_VERSION bump: no snapshot left, the whole history projected
    from zero in one catch-up, writing fold snapshots on the way (what --at then has to start from)."""
    with contextlib.suppress(Exception):
        await bus.js.delete_object_store(subjects.SNAPSHOT_BUCKET)
    await bus.ensure_streams()
    secs, folded, written = await project(bus, work / "rebuilt.duckdb", args.every)
    print(f"rebuilt: projected {folded:,} events from zero in {secs:.1f}s = {folded / secs:,.0f} events/s, "
          f"writing {written} fold snapshots")


async def measure(bus: Bus, url: str, work: Path, args: argparse.Namespace) -> None:
    folded = sum([await bus.stream_last_seq(s) for s in subjects.HISTORY_STREAMS])
    if "ctl" in args.parts:
        await measure_ctl(bus, url, args)
    if "startup" in args.parts:
        await measure_startup(bus, args)
    if "projector" in args.parts and args.rounds:
        await measure_projector(bus, work, folded, args)


async def worst_targets(bus: Bus, lo: int, hi: int) -> list[tuple[str, list[str]]]:
    """Just before each fold snapshot's moment, and just before the end: where ``--at`` folds the most
    events after the snapshot it starts from (every event since the one before, or since sequence 1)."""
    ends = sorted({h.newest_ns for h in (await snapshots.list_headers(bus)).values()} | {hi})
    out = []
    for end in ends:
        # A millisecond before it: the snapshot at ``end`` does not serve this moment, and nearly every event
        # up to it is folded. (A second before fell in the pause between two published chunks, where a
        # snapshot cut at the chunk's end has nothing left to fold.)
        at_ns = end - 10**6
        if at_ns > lo:
            pct = (at_ns - lo) / (hi - lo) * 100
            at = datetime.fromtimestamp(at_ns / 1e9, UTC).isoformat()
            out.append((f"--at {pct:.1f}%*", ["--at", at]))
    return out


async def measure_ctl(bus: Bus, url: str, args: argparse.Namespace) -> None:
    lo, hi = await stored_range(bus)
    print("\nctl status (a new process each run; median of --runs; * just before a fold snapshot's moment, "
          "where the most events are folded after the one before)")
    print(f"{'target':<14} {'snapshot: wall':>15} {'RSS':>9} {'--no-snapshot: wall':>21} {'RSS':>9}  ratio")
    targets: list[tuple[str, list[str]]] = []
    for pct in (10, 50, 90):
        at = datetime.fromtimestamp((lo + (hi - lo) * pct / 100) / 1e9, UTC).isoformat()
        targets.append((f"--at {pct}%", ["--at", at]))
    if args.worst:
        targets.extend(await worst_targets(bus, lo, hi))
    targets.append(("--replay", ["--replay"]))
    for name, extra in targets:
        row = {}
        for mode in ((), ("--no-snapshot",)) if args.no_snapshot else ((),):
            walls, rss = [], []
            for _ in range(args.runs):
                wall, peak, _ = run_cli("ctl", "status", "--json", "--nats-url", url, *extra, *mode)
                walls.append(wall)
                rss.append(peak)
            row[mode] = (statistics.median(walls), statistics.median(rss))
        (w1, r1), (w0, r0) = row[()], row.get(("--no-snapshot",), (float("nan"), float("nan")))
        print(f"{name:<14} {w1:>13.2f} s {r1:>6.0f} MiB {w0:>19.2f} s {r0:>6.0f} MiB  {w0 / w1:.1f}x")



async def measure_startup(bus: Bus, args: argparse.Namespace) -> None:
    """The services' start-up folds: from the newest snapshot, and from sequence 1 beside it."""
    from llmgw.planner.service import PlannerService
    from llmgw.router.endpoints import EndpointSink
    from llmgw.scheduler.service import FOLLOWED, SchedulerService

    print("\nstart-up fold (in this process; median of --runs)")
    for use in (True, False):
        sched_s, plan_s, route_s = [], [], []
        for _ in range(args.runs):
            svc = SchedulerService(bus, use_snapshots=use)
            start = time.perf_counter()
            if use:
                await svc.start_from_snapshot()
            tasks = [asyncio.create_task(svc._follow(s)) for s in FOLLOWED]
            lasts = {s: await bus.stream_last_seq(s) for s in FOLLOWED}
            while any(svc.stats.applied[s] < lasts[s] for s in FOLLOWED):  # noqa: ASYNC110 - a benchmark polls
                await asyncio.sleep(0.01)
            sched_s.append(time.perf_counter() - start)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            planner = PlannerService(bus, use_snapshots=use)
            plan_s.append(await _until_ready(planner.run(), planner.ready))
            sink = EndpointSink(bus, use_snapshots=use)
            route_s.append(await _until_ready(sink.run(), sink.caught_up))
        read = sum(lasts[s] - (svc.checkpoint.cursor.positions.get(s, 0) if use else 0) for s in FOLLOWED)
        print(f"{'from snapshot' if use else 'from sequence 1':<16} scheduler {statistics.median(sched_s):6.2f} s "
              f"({read:,} events read)   planner {statistics.median(plan_s):6.2f} s   "
              f"router {statistics.median(route_s):6.2f} s")



async def _until_ready(run: Coroutine[Any, Any, None], ready: asyncio.Event) -> float:
    """Seconds from starting a service's ``run`` until ``ready`` is set; the service is then stopped."""
    start = time.perf_counter()
    task = asyncio.create_task(run)
    await ready.wait()
    secs = time.perf_counter() - start
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return secs


async def measure_projector(bus: Bus, work: Path, folded: int, args: argparse.Namespace) -> None:
    print("\nprojector from zero, alternating (median of --rounds each)")
    with_s, without_s = [], []
    for _ in range(args.rounds):
        with_s.append((await project(bus, work / "a.duckdb", args.every))[0])
        without_s.append((await project(bus, work / "b.duckdb", None))[0])
    a, b = statistics.median(with_s), statistics.median(without_s)
    print(f"with snapshots {folded / a:,.0f} events/s, without {folded / b:,.0f} events/s: "
          f"snapshots cost {(a - b) / b:+.1%}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--every", type=int, default=snapshots.DEFAULT_EVERY_EVENTS,
                   help="fold snapshot every so many events [default: llmgw project's]")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workdir")
    p.add_argument("--parts", default="ctl,startup,projector", help="what to measure (comma-separated)")
    p.add_argument("--rebuild", action="store_true",
                   help="drop the fold snapshots and project the whole history from zero first (a rebuild)")
    p.add_argument("--worst", action="store_true",
                   help="also --at just before each fold snapshot (where the most events are folded after one)")
    p.add_argument("--no-snapshot", dest="no_snapshot", action=argparse.BooleanOptionalAction, default=True,
                   help="time each target with --no-snapshot beside it (--no-no-snapshot: only with snapshots)")
    p.add_argument("--store", help="keep the server's store here; when it exists, measure on it without publishing")
    asyncio.run(main(p.parse_args()))
