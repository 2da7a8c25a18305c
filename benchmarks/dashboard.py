"""What open dashboards cost the projector: its CPU with no page open, with 20, and with 20 naive pollers.

A fleet of ``--nodes`` nodes (8 GPUs each, a replica on every other node) is
published, every node's agent heartbeats with its GPU samples every
``--heartbeat-s`` (as the simulated agents do, from this process), and a real
``llmgw project`` and ``llmgw dashboard`` run as child processes. The
projector's CPU (its process and children, from /proc) is measured for
``--seconds`` in each phase:

1. the dashboard runs, no page is open (it asks nothing);
2. 20 pages are open (20 Server-Sent Events streams on the one dashboard);
3. for comparison, 20 pollers that each ask the status service every interval,
   as 20 pages would if each asked for itself.

    .venv/bin/python benchmarks/dashboard.py                  # 500 nodes, 30 s a phase
    .venv/bin/python benchmarks/dashboard.py --nodes 100 --seconds 10

Prints figures; asserts nothing (timing belongs here, not in tests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.bus.server import EmbeddedServer
from llmgw.config import Settings
from llmgw.errors import NoServiceError
from llmgw.proc import descendants

LLMGW = str(Path(sys.executable).with_name("llmgw"))
TICK = os.sysconf("SC_CLK_TCK")
PAGES = 20


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and everything below it."""
    total = 0
    for p in descendants([pid]):
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{p}/stat").read_bytes()
            fields = stat[stat.rindex(b")") + 2:].split()
            total += int(fields[11]) + int(fields[12])
    return total / TICK


def fleet(nodes: int) -> list[m.Event]:
    at = datetime.now(UTC)
    spec = m.ModelSpec(name="qwen", source="Qwen/Qwen2.5-14B-Instruct", precision="bf16", engine="vllm",
                       gpu_class="H100-80GB", context=8192, tp=8, replicas=nodes // 2, gib_per_gpu=70)
    out: list[m.Event] = [m.ModelDeclared(at=at, spec=spec)]
    for i in range(nodes):
        name = f"node-{i:04d}"
        out.append(m.NodeInventoryReported(
            at=at, node=name, fabric=f"ib-{i // 64}", fabric_source="fleet-file", boot_id="b", simulated=True,
            gpus=tuple(m.GpuInfo(index=g, uuid=f"GPU-{name}-{g}", name="NVIDIA H100 80GB HBM3", gpu_class="H100-80GB",
                                 memory_mib=81559) for g in range(8))))
        if i % 2 == 0:
            rid = f"qwen-r{i}"
            out.append(m.ReplicaPlaced(at=at, replica_id=rid, model="qwen", nodes=(name,), spec=spec,
                                       gpus=tuple(m.GpuRef(node=name, index=g, uuid=f"GPU-{name}-{g}") for g in range(8))))
            out.append(m.ReplicaStateChanged(at=at, replica_id=rid, model="qwen", node=name, state="healthy",
                                             endpoint=f"http://{name}:8000", observed_memory_mib=8 * 71_000))
    return out


def beat(node: int, seq: int, busy: bool) -> bytes:
    rng = random.Random(node * 7919 + seq)
    gpus = tuple(m.GpuSample(index=g, utilization_pct=rng.randint(55, 97) if busy else 0,
                             memory_used_mib=71_000 if busy else 4, memory_total_mib=81559,
                             temperature_c=70 if busy else 31, power_w=600.0 if busy else 70.0,
                             processes=(m.GpuProcess(pid=1000 + node, used_mib=71_000),) if busy else ())
                 for g in range(8))
    return m.encode(m.HeartbeatSent(at=datetime.now(UTC), node=f"node-{node:04d}", boot_id="b", seq=seq, gpus=gpus))


async def heartbeats(bus: Bus, nodes: int, every_s: float) -> None:
    """Every node's heartbeat once per ``every_s``, spread evenly over it."""
    seq = 0
    while True:
        seq += 1
        start = time.monotonic()
        for i in range(nodes):
            await bus.publish_core(subjects.heartbeat(f"node-{i:04d}"), beat(i, seq, i % 2 == 0))
            await asyncio.sleep(max(0.0, start + every_s * (i + 1) / nodes - time.monotonic()))


async def measure(pid: int, seconds: float) -> float:
    """The projector's CPU over ``seconds``, as a percentage of one core."""
    before, t0 = cpu_s(pid), time.monotonic()
    await asyncio.sleep(seconds)
    return 100 * (cpu_s(pid) - before) / (time.monotonic() - t0)


async def pages(url: str, n: int, stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        async def page() -> None:
            async with http.get(url + "events") as r:
                async for _ in r.content.iter_any():
                    if stop.is_set():
                        return

        tasks = [asyncio.create_task(page()) for _ in range(n)]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def pollers(bus: Bus, n: int, every_s: float, stop: asyncio.Event) -> None:
    req = m.encode(m.StatusRequest(idle_threshold_s=0, gpus=True, wait_s=0))

    async def poll(offset: float) -> None:
        await asyncio.sleep(offset)
        while not stop.is_set():
            await bus.request(subjects.STATUS, req, timeout=10)
            await asyncio.sleep(every_s)

    await asyncio.gather(*(poll(every_s * i / n) for i in range(n)))


def spawn(env: dict[str, str], *args: str, quiet: bool = False) -> subprocess.Popen[bytes]:
    """An ``llmgw`` child; unless quiet, its first line can be read (the dashboard prints its URL)."""
    return subprocess.Popen([LLMGW, *args], env=env, stdout=subprocess.DEVNULL if quiet else subprocess.PIPE,
                            stderr=subprocess.DEVNULL)


async def main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="llmgw-bench-dash-"))
    server = EmbeddedServer(root / "nats", port=0).start()
    env = dict(os.environ, LLMGW_NATS_URL=server.url)
    procs: list[subprocess.Popen[bytes]] = []
    beating: list[asyncio.Task[None]] = []
    bus = await Bus.connect(Settings(nats_url=server.url), "bench-dashboard")
    try:
        await bus.ensure_streams()
        await bus.publish_many(fleet(args.nodes))
        beating.append(asyncio.create_task(heartbeats(bus, args.nodes, args.heartbeat_s)))
        projector = spawn(env, "project", "--db", str(root / "p.duckdb"), quiet=True)
        board = spawn(env, "dashboard", "--listen", "127.0.0.1:0", "--interval", f"{args.interval:g}")
        procs += [projector, board]
        assert board.stdout is not None
        url = (await asyncio.to_thread(board.stdout.readline)).decode().strip()
        for _ in range(300):  # the projector's status service, once it has started
            with contextlib.suppress(NoServiceError):
                data = await bus.request(subjects.STATUS, m.encode(m.StatusRequest(gpus=True)), timeout=30)
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(args.heartbeat_s + 2)  # the projector has read every node's first heartbeat
        data = await bus.request(subjects.STATUS, m.encode(m.StatusRequest(idle_threshold_s=0, gpus=True)))
        report, size = m.STATUS_REPORT_DECODER.decode(data), len(data)
        print(f"{args.nodes} nodes ({args.nodes * 8} GPUs), {report.replicas} replicas, heartbeats every "
              f"{args.heartbeat_s:g}s with GPU samples; dashboard {url} asks every {args.interval:g}s while a page is "
              f"open; a full status answer is {size / 1024:,.0f} KiB")

        idle = await measure(projector.pid, args.seconds)
        print(f"no page open:                 projector {idle:5.2f}% of a core")

        stop = asyncio.Event()
        opened = asyncio.create_task(pages(url, PAGES, stop))
        await asyncio.sleep(1)
        open20 = await measure(projector.pid, args.seconds)
        stop.set()
        await opened
        print(f"{PAGES} pages open (one view):     projector {open20:5.2f}% of a core   "
              f"(+{open20 - idle:.2f} points, {100 * (open20 - idle) / idle:+.0f}%)")

        stop = asyncio.Event()
        polling = asyncio.create_task(pollers(bus, PAGES, args.interval, stop))
        naive = await measure(projector.pid, args.seconds)
        stop.set()
        await polling
        print(f"{PAGES} pollers (one each, naive): projector {naive:5.2f}% of a core   "
              f"(+{naive - idle:.2f} points, {100 * (naive - idle) / idle:+.0f}%)")
    finally:
        for t in beating:
            t.cancel()
        await asyncio.gather(*beating, return_exceptions=True)
        for p in procs:
            p.terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        await bus.close()
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--heartbeat-s", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=5.0, help="the dashboard's (and the pollers') interval")
    parser.add_argument("--seconds", type=float, default=30.0, help="each phase")
    asyncio.run(main(parser.parse_args()))
