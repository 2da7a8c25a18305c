"""Replay benchmark: publish a busy week of fleet history, then measure, in one run,
the raw read rate, the projector's rate from zero into DuckDB, and ``ctl status`` latency.

The raw read is measured twice: through nats-py's own message path (its parser,
a ``Msg`` per message, a client-driven pull loop: what nats-py can do) and
through ``Bus.reader``'s fast lane (what the projector reads with). The same
read, decode and fold with no store shows what is left for DuckDB, and each
step prints its CPU per event: this process, the DuckDB writer process, and
the embedded nats-server (from /proc).

    .venv/bin/python benchmarks/replay.py                 # embedded nats-server, 1M events
    .venv/bin/python benchmarks/replay.py --events 200000 # quicker
    .venv/bin/python benchmarks/replay.py --events 300000 --rounds 3  # the projector ÷ fold-only ratio

Prints figures; asserts nothing (timing belongs here, not in tests).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.bus.server import EmbeddedServer
from llmgw.config import Settings
from llmgw.fleet import snapshots
from llmgw.projections.runner import Projector
from llmgw.projections.store import Store

T0 = datetime(2026, 3, 2, tzinfo=UTC)
CLASSES = ("H100-80GB", "A100-80GB", "L40S-48GB", "H200-141GB")


def history(events: int, nodes: int, gpus: int, days: float, routers: int, tick_s: float,
            live_replicas: int, busy: int, seed: int = 7) -> Iterator[m.Event]:
    """A week of a fleet, in time order: idle maps every tick, the rest health flaps and replica churn."""
    rng = random.Random(seed)
    names = [f"gpu-{i:04d}" for i in range(nodes)]
    fabric = {n: f"ib-{i // 32}" for i, n in enumerate(names)}
    klass = {n: CLASSES[(i // 64) % len(CLASSES)] for i, n in enumerate(names)}
    for n in names:
        yield m.NodeInventoryReported(
            at=T0, node=n, fabric=fabric[n], fabric_source="fleet-file", boot_id=f"{n}-0", simulated=True,
            gpus=tuple(m.GpuInfo(index=i, uuid=f"GPU-{n}-{i}", name=klass[n], gpu_class=klass[n],
                                 memory_mib=81559) for i in range(gpus)),
        )
    models = [m.ModelSpec(name=f"model-{i:02d}", source=f"org/model-{i:02d}", precision="bf16", engine="vllm",
                          gpu_class=CLASSES[i % len(CLASSES)], context=8192, tp=(1, 2, 4, 8)[i % 4])
              for i in range(32)]
    for spec in models:
        yield m.ModelDeclared(at=T0, spec=spec)
    ticks = int(days * 86400 / tick_s)
    usage_events = ticks * routers
    other = max(0, events - usage_events - nodes - len(models))
    per_tick_other = other / ticks
    live: dict[str, m.ReplicaPlaced] = {}
    last_request: dict[str, datetime] = {}
    placed_at: dict[str, datetime] = {}
    next_id = 0
    owed = 0.0
    for k in range(ticks):
        now = T0 + timedelta(seconds=(k + 1) * tick_s)
        owed += per_tick_other
        while owed >= 1:
            roll = rng.random()
            if roll < 0.3:
                n = rng.choice(names)
                i = rng.randrange(gpus)
                healthy = rng.random() < 0.5
                yield m.GpuHealthChanged(at=now, node=n, gpu_index=i, gpu_uuid=f"GPU-{n}-{i}", healthy=healthy,
                                         reasons=() if healthy else ("xid-79",))
                owed -= 1
            elif len(live) < live_replicas or roll < 0.5:
                spec = rng.choice(models)
                node = rng.choice(names)
                rid = f"r{next_id:06d}"
                next_id += 1
                placed = m.ReplicaPlaced(
                    at=now, replica_id=rid, model=spec.name, nodes=(node,), fabric=fabric[node], spec=spec,
                    gpus=tuple(m.GpuRef(node=node, index=i, uuid=f"GPU-{node}-{i}") for i in range(spec.tp)),
                )
                live[rid], placed_at[rid] = placed, now
                yield placed
                yield m.ReplicaStateChanged(at=now, replica_id=rid, model=spec.name, node=node, state="healthy",
                                            endpoint=f"http://{node}:8000")
                owed -= 2
            else:
                rid = rng.choice(list(live))
                gone = live.pop(rid)
                last_request.pop(rid, None)
                placed_at.pop(rid, None)
                yield m.ReplicaStopped(at=now, replica_id=rid, model=gone.model, reason="idle")
                owed -= 1
        ids = list(live)
        for rid in rng.sample(ids, min(busy, len(ids))):
            last_request[rid] = now - timedelta(seconds=rng.random() * tick_s)
        for r in range(routers):
            yield m.IdleMapPublished(
                at=now, router=f"router-{r}", boot_id=f"router-{r}-0", tick=k,
                last_request={rid: t for rid, t in last_request.items() if rid in live},
                serving_since={rid: placed_at[rid] for rid in ids if rid not in last_request},
            )


async def publish(bus: Bus, events: Iterator[m.Event], window: int) -> tuple[int, float]:
    """Publish fast: core publishes with the same Nats-Msg-Id Bus.publish would set, a flush
    (PING/PONG, after which the server has taken everything before it) every ``window``.

    Bus.publish waits for each ack (~7k/s here); JetStream stores a core publish all the same,
    and the caller checks the stored count against what was sent.
    """
    n = 0
    start = time.perf_counter()
    for event in events:
        payload = m.encode(event)
        await bus.nc.publish(subjects.subject_for(event), payload,
                             headers={"Nats-Msg-Id": subjects.msg_id(event, payload)})
        n += 1
        if n % window == 0:
            await bus.nc.flush(timeout=60)
    await bus.nc.flush(timeout=60)
    return n, time.perf_counter() - start


class Cpu:
    """CPU seconds from here on: this process, its finished children (the DuckDB writer), nats-server."""

    def __init__(self, server_pid: int | None) -> None:
        self.server_pid = server_pid
        self.start = self._now()

    def _now(self) -> tuple[float, float, float]:
        t = os.times()
        server = 0.0
        if self.server_pid is not None:
            fields = Path(f"/proc/{self.server_pid}/stat").read_text().rsplit(")", 1)[1].split()
            server = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        return t.user + t.system, t.children_user + t.children_system, server

    def per_event(self, n: int) -> str:
        now = self._now()
        reader, writer, server = ((b - a) / n * 1e6 for a, b in zip(self.start, now, strict=True))
        parts = [f"reading process {reader:.1f} µs"]
        if writer:
            parts.append(f"writer process {writer:.1f} µs")
        if self.server_pid is not None:
            parts.append(f"nats-server {server:.1f} µs")
        return ", ".join(parts)


def load() -> str:
    """The 1, 5 and 15 minute load averages: how much else this machine was running."""
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


async def fresh(bus: Bus) -> None:
    """Empty streams (a server given by --nats-url may hold an earlier run's): delete them, declare them again."""
    for spec in subjects.STREAMS:
        try:
            await bus.js.delete_stream(spec.name)
        except Exception:  # noqa: BLE001 - absent is fine
            pass
    await bus.ensure_streams()


async def raw_read(bus: Bus) -> tuple[int, float]:
    """Every history stream read concurrently with Bus.reader, nothing decoded."""
    count = 0

    async def one(stream: str) -> None:
        nonlocal count
        last = await bus.stream_last_seq(stream)
        if last == 0:
            return
        async for msgs in bus.reader(stream, 1, batch=8192, stop_at=last).batches():
            count += len(msgs)

    start = time.perf_counter()
    await asyncio.gather(*(one(s) for s in subjects.HISTORY_STREAMS))
    return count, time.perf_counter() - start


async def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-replay-", dir=args.workdir))
    server = None
    url = args.nats_url
    if not url:
        server = EmbeddedServer(work / "nats", port=0)
        server.start()
        url = server.url
    settings = Settings(nats_url=url, request_timeout_s=30.0)  # a server busy with 1M messages answers slowly
    try:
        bus = await Bus.connect(settings, "llmgw-bench")
        await fresh(bus)
        gen = history(args.events, args.nodes, args.gpus, args.days, args.routers, args.tick,
                      args.live_replicas, args.busy)
        n, secs = await publish(bus, gen, args.window)
        sizes = {s: await bus.stream_last_seq(s) for s in subjects.HISTORY_STREAMS}
        while True:  # JetStream may still be storing what the flushes handed it
            await asyncio.sleep(1.0)
            now = {s: await bus.stream_last_seq(s) for s in subjects.HISTORY_STREAMS}
            if now == sizes:
                break
            sizes = now
        print(f"published {n:,} events in {secs:.1f}s ({n / secs:,.0f}/s); stored {sum(sizes.values()):,} "
              "(identical events are stored once): "
              + ", ".join(f"{k.removeprefix('LLMGW_').lower()} {v:,}" for k, v in sizes.items())
              + f"; load average {load()}")

        server_pid = server.proc.pid if server is not None and server.proc is not None else None
        plain = await Bus.connect(settings, "llmgw-bench-plain", fast_reads=False)
        cpu = Cpu(server_pid)
        nats_n, nats_s = await raw_read(plain)
        await plain.close()
        nats_rate = nats_n / nats_s
        print(f"raw read:  {nats_n:,} msgs in {nats_s:.2f}s = {nats_rate:,.0f} msgs/s "
              f"(nats-py's message path, client-driven pull loop, no decode); CPU per event: {cpu.per_event(nats_n)}")
        cpu = Cpu(server_pid)
        raw_n, raw_s = await raw_read(bus)
        raw_rate = raw_n / raw_s
        print(f"raw read:  {raw_n:,} msgs in {raw_s:.2f}s = {raw_rate:,.0f} msgs/s (Bus.reader's fast lane, no decode); "
              f"CPU per event: {cpu.per_event(raw_n)}")

        # The same read, decode and fold with no store (what is left for DuckDB), then the projector
        # into a new file, alternated round by round: the ratio of each pair is measured side by side.
        folds, projs, ratios = [], [], []
        for r in range(1, args.rounds + 1):
            cpu = Cpu(server_pid)
            start = time.perf_counter()
            folder = Projector(bus, None)
            await folder.run_once()
            fold_s = time.perf_counter() - start
            fold_rate = folder.folded / fold_s
            print(f"fold only: {folder.folded:,} events in {fold_s:.2f}s = {fold_rate:,.0f} events/s "
                  f"(read, decode, fold; no DuckDB); CPU per event: {cpu.per_event(folder.folded)}")

            db = work / "bench.duckdb"
            for old in (db, db.with_name(db.name + ".wal")):
                old.unlink(missing_ok=True)
            store = Store(db)
            cpu = Cpu(server_pid)
            start = time.perf_counter()
            # Fold snapshots at ``llmgw project``'s cadence, so that a kept history serves ``--at`` as a real one does.
            projector = Projector(bus, store, writer_process=not args.writer_thread,
                                  commit_interval_s=args.commit_interval,
                                  fold_snapshot_events=args.fold_snapshot_events or None,
                                  fold_snapshot_interval_s=snapshots.DEFAULT_INTERVAL_S)
            state = (await projector.run_once()).state
            proj_s = time.perf_counter() - start
            store.close()
            proj_rate = projector.folded / proj_s
            print(f"projector: {projector.folded:,} events in {proj_s:.2f}s = {proj_rate:,.0f} events/s "
                  f"({proj_rate / nats_rate:.0%} of nats-py's raw read, {proj_rate / raw_rate:.0%} of the fast lane's) "
                  f"into {db.stat().st_size / 2**20:,.0f} MiB of DuckDB")
            print(f"           {len(state.nodes)} nodes, {len(state.replicas)} replicas, {len(state.routers)} routers; "
                  f"CPU per event: {cpu.per_event(projector.folded)}")
            folds.append(fold_rate)
            projs.append(proj_rate)
            ratios.append(proj_rate / fold_rate)
            print(f"round {r}:   projector ÷ fold only {ratios[-1]:.2f}; load average {load()}")
        if args.rounds > 1:
            print(f"medians of {args.rounds} rounds: fold only {statistics.median(folds):,.0f} events/s, projector "
                  f"{statistics.median(projs):,.0f} events/s, projector ÷ fold only {statistics.median(ratios):.2f} "
                  f"(each round's: {' / '.join(f'{x:.2f}' for x in ratios)})")

        store = Store(db)
        live = Projector(bus, store)
        task = asyncio.create_task(live.run_forever())
        req = m.encode(m.StatusRequest())
        # The first answer after a start (the projector resumes from its checkpoint, the models'
        # history in it; before fold version 2 it read the control stream's history once): timed on
        # its own, then the steady state.
        t = time.perf_counter()
        first = await bus.request(subjects.STATUS, m.encode(m.StatusRequest(wait_s=30)), timeout=40)
        first_s = time.perf_counter() - t
        if b'"error"' in first[:40]:
            raise SystemExit(f"status service: {first.decode()}")
        lat = []
        for _ in range(args.status_runs):
            t = time.perf_counter()
            await bus.request(subjects.STATUS, req, timeout=10)
            lat.append((time.perf_counter() - t) * 1000)
        cli = []
        for _ in range(3):
            t = time.perf_counter()
            proc = await asyncio.create_subprocess_exec(
                str(Path(sys.executable).with_name("llmgw")), "ctl", "status", "--nats-url", url,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
            _, err = await proc.communicate()
            if proc.returncode:
                raise SystemExit(f"llmgw ctl status failed: {err.decode()}")
            cli.append((time.perf_counter() - t) * 1000)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        store.close()
        lat.sort()
        print(f"status:    service {statistics.median(lat):.1f} ms median, {lat[int(len(lat) * 0.95) - 1]:.1f} ms p95 "
              f"({args.status_runs} requests); `llmgw ctl status` end to end {statistics.median(cli):.0f} ms median; "
              f"the first answer after the projector started {first_s:.2f}s")
        await bus.close()
    finally:
        if server is not None:
            server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nats-url", help="use this server instead of an embedded one (its streams are wiped!)")
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--nodes", type=int, default=256)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--days", type=float, default=7)
    p.add_argument("--routers", type=int, default=2)
    p.add_argument("--tick", type=float, default=10.0)
    p.add_argument("--live-replicas", type=int, default=48)
    p.add_argument("--busy", type=int, default=6, help="replicas that get requests each tick")
    p.add_argument("--window", type=int, default=10_000, help="publishes between flushes")
    p.add_argument("--status-runs", type=int, default=50)
    p.add_argument("--rounds", type=int, default=1, help="fold only and projector, alternated, this many times")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--writer-thread", action="store_true", help="commit in a thread instead of a child process")
    p.add_argument("--commit-interval", type=float, default=1.0, help="seconds between commits (as llmgw project)")
    p.add_argument("--fold-snapshot-events", type=int, default=snapshots.DEFAULT_EVERY_EVENTS,
                   help="the projector writes a fold snapshot every so many events (0: none) [default: llmgw project's]")
    p.add_argument("--workdir", help="where the nats store and DuckDB file go (e.g. /dev/shm on a busy disk)")
    asyncio.run(main(p.parse_args()))
