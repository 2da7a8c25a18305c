"""What the router adds: direct to a fake engine vs. the thinnest aiohttp pass-through vs. the router.

    python benchmarks/router.py --quick        # a few minutes
    python benchmarks/router.py                # fuller runs, 3 rounds, 100,000-request memory run
    python benchmarks/router.py --memory-only --memory-requests 100000
    python benchmarks/router.py --quick --keys 10000   # 10,000 keys on the bus, one used by every request
    python benchmarks/router.py --quick --before ../before   # and the router of another checkout, side by side

Starts its own nats-server, two fake engines (instant; realistic: 20 ms before
the reply, 5 ms between chunks), two pass-through proxies per engine (the floor, on
aiohttp's client, and the same on llmgw's HTTP/1.1 client, the router's own), and two
routers (idle tracking on and off), all as separate processes. Every scenario
runs the targets back to back so the ratios are side by side. CPU per request
is the proxy process's on-CPU time (all threads, /proc/<pid>/task/*/schedstat)
over the requests it served. Prints medians over rounds and a markdown table.
With ``--keys N``, N API keys are declared on the bus (each with a requests-per-minute
and a tokens-per-day limit no run reaches) and every request carries one of them: the
routers check it, count it against its quotas and add it to the per-key ledger (the
pass-through ignores it).
With ``--before DIR``, a third router runs the code of another checkout (``git worktree add
--detach ../before main``), beside this one, so that a change's before and after are measured
in the same run, on the same box, in the same minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from llmgw import ctl
from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.bus.server import EmbeddedServer
from llmgw.config import Settings
from llmgw.engine.fake import EngineProcess, spawn

CHUNKS = 20
HERE = str(Path(__file__).resolve())


# --- the floor: the thinnest pass-through proxy this box can run in Python -----------


def passthrough_main(upstream: str, lean: bool = False) -> None:
    """A few lines of aiohttp: one shared session, bodies and streams copied as they come.

    With ``lean``, the same on llmgw's own HTTP/1.1 client (``llmgw/engine/http1.py``), the router's
    way to its engines: the floor of a proxy built the way the router now is."""
    import uvloop
    from aiohttp import web

    from llmgw.engine.http1 import Client

    async def main() -> None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        client = Client(connect_s=5, read_s=300)

        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            async with session.post(upstream + request.path, data=body,
                                    headers={"Content-Type": "application/json"}) as up:
                if up.content_type == "text/event-stream":
                    resp = web.StreamResponse(status=up.status, headers={"Content-Type": "text/event-stream"})
                    await resp.prepare(request)
                    async for chunk in up.content.iter_any():
                        await resp.write(chunk)
                    await resp.write_eof()
                    return resp
                return web.Response(status=up.status, body=await up.read(), content_type=up.content_type)

        async def handle_lean(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            up = await client.post(upstream, request.path, body, {"Content-Type": "application/json"})
            try:
                if up.content_type.startswith("text/event-stream"):
                    resp = web.StreamResponse(status=up.status, headers={"Content-Type": "text/event-stream"})
                    await resp.prepare(request)
                    while chunk := await up.readany():
                        await resp.write(chunk)
                    await resp.write_eof()
                    return resp
                return web.Response(status=up.status, body=await up.read(),
                                    headers={"Content-Type": up.content_type or "application/json"})
            finally:
                up.release()

        app = web.Application()
        app.router.add_post("/{tail:.*}", handle_lean if lean else handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", flush=True)  # type: ignore[union-attr]
        await asyncio.Event().wait()

    uvloop.run(main())


# --- processes ----------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    url: str

    def cpu_ns(self) -> int:
        """On-CPU nanoseconds of every thread of the process so far."""
        total = 0
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError):
                pass  # a thread that just exited
        return total

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_proc(name: str, cmd: list[str], tree: str | None = None) -> Proc:
    """Start ``cmd``; with ``tree``, with that checkout's ``llmgw`` ahead of the installed one."""
    env = None if tree is None else {**os.environ, "PYTHONPATH": tree}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, cwd=tree)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    if not line.startswith("http"):
        proc.kill()
        raise SystemExit(f"{name} did not start (exit {proc.wait()})")
    return Proc(name, proc, line)


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (--pin)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def engine_proc(e: EngineProcess, name: str) -> Proc:
    return Proc(name, e.proc, e.url)


# --- load ---------------------------------------------------------------------------


@dataclass
class Result:
    rps: float
    p50_ms: float
    p99_ms: float
    ttfb_ms: float
    cpu_us: float | None


AUTH: dict[str, str] = {}  # the Authorization header every request carries (--keys)


def declared_key(name: str) -> tuple[str, m.KeyDeclared]:
    """A key as ``ctl key create`` makes one, with limits no run of this benchmark reaches."""
    secret, key_id, salt, digest = ctl.new_key_secret()
    return secret, m.KeyDeclared(at=datetime.now(UTC), name=name, lookup_id=key_id, salt=salt, digest=digest,
                                 requests_per_minute=10**9, tokens_per_day=10**12)


async def load(session: aiohttp.ClientSession, url: str, model: str, stream: bool, n: int, conc: int,
               proxy: Proc | None) -> Result:
    body = m.ENCODER.encode({"model": model, "stream": stream,
                             "messages": [{"role": "user", "content": "hello"}]})
    headers = {"Content-Type": "application/json", **AUTH}
    lat: list[float] = []
    ttfb: list[float] = []
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            t0 = time.perf_counter()
            async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as resp:
                if resp.status != 200:
                    raise SystemExit(f"{url}: HTTP {resp.status}: {await resp.text()}")
                if stream:
                    first = True
                    async for _ in resp.content.iter_any():
                        if first:
                            ttfb.append(time.perf_counter() - t0)
                            first = False
                else:
                    await resp.read()
            lat.append(time.perf_counter() - t0)

    cpu0 = proxy.cpu_ns() if proxy else 0
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    wall = time.perf_counter() - t0
    cpu = (proxy.cpu_ns() - cpu0) / n / 1000 if proxy else None
    lat.sort()
    return Result(
        rps=n / wall,
        p50_ms=statistics.median(lat) * 1000,
        p99_ms=lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000,
        ttfb_ms=statistics.median(ttfb) * 1000 if ttfb else float("nan"),
        cpu_us=cpu,
    )


def med(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


async def run(args: argparse.Namespace) -> None:
    store = Path(tempfile.mkdtemp(prefix="llmgw-bench-router-"))
    server = EmbeddedServer(store, port=0).start()
    procs: list[Proc] = []
    engines: list[EngineProcess] = []
    try:
        instant = spawn("instant", "--chunks", str(CHUNKS), name="instant")
        engines.append(instant)
        realistic = spawn("realistic", "--chunks", str(CHUNKS), "--latency-ms", "20", "--chunk-interval-ms", "5",
                          name="realistic")
        engines.append(realistic)
        here = HERE
        pass_i = start_proc("pass-instant", [sys.executable, here, "--passthrough-proxy", instant.url])
        pass_r = start_proc("pass-realistic", [sys.executable, here, "--passthrough-proxy", realistic.url])
        lean_i = start_proc("lean-instant", [sys.executable, here, "--passthrough-proxy", instant.url, "--lean"])
        lean_r = start_proc("lean-realistic", [sys.executable, here, "--passthrough-proxy", realistic.url, "--lean"])
        procs += [pass_i, pass_r, lean_i, lean_r]
        settings = Settings(nats_url=server.url)
        async with await Bus.connect(settings, "bench") as bus:
            await bus.ensure_streams()
            for rid, model, url in (("instant", "instant", instant.url), ("realistic", "realistic", realistic.url)):
                # The router believes a replica's state only from a node it was placed on.
                spec = m.ModelSpec(name=model, source="x", precision="bf16", engine="vllm", gpu_class="H100", context=4096)
                await bus.publish(m.ReplicaPlaced(at=datetime.now(UTC), replica_id=rid, model=model, nodes=("bench",),
                                                  gpus=(m.GpuRef(node="bench", index=0, uuid=f"GPU-{rid}"),), spec=spec))
                await bus.publish(m.ReplicaStateChanged(at=datetime.now(UTC), replica_id=rid, model=model,
                                                        node="bench", state="healthy", endpoint=url))
            if args.keys:
                keys = [declared_key(f"bench-{i}") for i in range(args.keys)]
                await bus.publish_many([k for _, k in keys])
                AUTH["Authorization"] = f"Bearer {keys[len(keys) // 2][0]}"
        cli = [sys.executable, "-m", "llmgw", "router", "--listen", "127.0.0.1:0",
               "--nats-url", server.url]
        router_on = start_proc("router", [*cli, "--name", "bench-on", "--tick", "10"])
        router_off = start_proc("router-notrack", [*cli, "--name", "bench-off", "--no-idle-tracking"])
        procs += [router_on, router_off]
        if args.pin:  # the proxies on the second CPU, engines, load and NATS on the first
            for p in procs:
                pin(p.proc.pid, {1})
            for pid in (instant.proc.pid, realistic.proc.pid, *([server.proc.pid] if server.proc else []), os.getpid()):
                pin(pid, {0})
        before: list[tuple[str, str, Proc | None]] = []
        if args.before:
            router_before = start_proc("router-before", [*cli, "--name", "bench-before", "--tick", "10"],
                                       args.before)
            procs.append(router_before)
            if args.pin:
                pin(router_before.proc.pid, {1})
            before = [("router, before", router_before.url, router_before)]

        q = args.quick
        sizes = {  # (engine, concurrency) -> requests per target per round
            ("instant", 1): 1000 if q else 2000,  # a round of 300 (0.2 s) swung by ±30 %
            ("instant", 64): 1500 if q else 15000,
            ("realistic", 1): 30 if q else 200,
            ("realistic", 64): 640 if q else 3200,
        }
        rounds = args.rounds
        targets = {
            "instant": [("direct", instant.url, None), ("pass-through", pass_i.url, pass_i),
                        ("pass-through, http1", lean_i.url, lean_i),
                        ("router", router_on.url, router_on), *before,
                        ("router, idle off", router_off.url, router_off)],
            "realistic": [("direct", realistic.url, None), ("pass-through", pass_r.url, pass_r),
                          ("pass-through, http1", lean_r.url, lean_r),
                          ("router", router_on.url, router_on), *before],
        }
        rows: list[list[str]] = []
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as session:
            # Warm every path (connections, code) before measuring.
            for model, tlist in targets.items():
                for _, url, _p in tlist:
                    await load(session, url, model, False, 200, 8, None)
                    await load(session, url, model, True, 50, 8, None)
            for model in () if args.memory_only else ("instant", "realistic"):
                for stream in (False, True):
                    for conc in (1, 64):
                        n = sizes[(model, conc)]
                        results: dict[str, list[Result]] = {name: [] for name, _, _ in targets[model]}
                        for rnd in range(rounds):
                            tl = targets[model]
                            # Rotate the order each round so no target always runs first (warmest box).
                            for name, url, proxy in tl[rnd % len(tl):] + tl[:rnd % len(tl)]:
                                results[name].append(await load(session, url, model, stream, n, conc, proxy))
                        base = results["direct"]
                        floor = results["pass-through"]
                        for name, rs in results.items():
                            p50 = med([r.p50_ms for r in rs])
                            added = None if name == "direct" else (p50 or 0) - (med([r.p50_ms for r in base]) or 0)
                            rps = med([r.rps for r in rs])
                            cpu = med([r.cpu_us for r in rs])
                            floor_cpu = med([r.cpu_us for r in floor])
                            rows.append([
                                model, "stream" if stream else "json", str(conc), name, fmt(rps, 0),
                                fmt(p50), fmt(med([r.p99_ms for r in rs])), fmt(added),
                                fmt(med([r.ttfb_ms for r in rs])) if stream else "-",
                                fmt((rps or 0) / (med([r.rps for r in base]) or 1)),
                                fmt(cpu, 0), fmt(None if cpu is None or not floor_cpu else cpu / floor_cpu),
                            ])
                            print(" | ".join(rows[-1]), flush=True)
            # Memory over a long run: the router's RSS before and after.
            total = args.memory_requests
            rss0 = router_on.rss_mib()
            await load(session, router_on.url, "instant", False, total // 2, 32, None)
            rss_mid = router_on.rss_mib()
            await load(session, router_on.url, "instant", True, total // 10, 32, None)
            await load(session, router_on.url, "instant", False, total - total // 2 - total // 10, 32, None)
            rss1 = router_on.rss_mib()

        header = ["engine", "kind", "conc", "target", "req/s", "p50 ms", "p99 ms", "added p50 ms",
                  "TTFB p50 ms", "× direct req/s", "CPU µs/req", "× floor CPU"]
        print()
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        print()
        print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; rounds: {rounds}; "
              f"{'pinned; ' if args.pin else ''}"
              f"keys on the bus: {args.keys:,}" + (f"; before: {args.before}" if args.before else ""))
        print(f"router RSS over {total} requests: {rss0:.1f} MiB → {rss_mid:.1f} MiB (half) → {rss1:.1f} MiB")
    finally:
        for p in procs:
            p.stop()
        for e in engines:
            e.stop()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer requests per round (a few minutes)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-requests", type=int, default=None, help="length of the memory run")
    parser.add_argument("--memory-only", action="store_true", help="only the memory run")
    parser.add_argument("--keys", type=int, default=0, metavar="N",
                        help="declare N API keys on the bus; every request carries one (default: none, anonymous)")
    parser.add_argument("--before", metavar="DIR",
                        help="also run the router of the llmgw checkout in DIR (its 'before'), side by side")
    parser.add_argument("--passthrough-proxy", metavar="UPSTREAM", help=argparse.SUPPRESS)
    parser.add_argument("--pin", action="store_true",
                        help="proxies and routers on CPU 1, engines, NATS and the load on CPU 0 (two CPUs or more)")
    parser.add_argument("--lean", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.passthrough_proxy:
        passthrough_main(args.passthrough_proxy, args.lean)
        return
    if args.before:
        args.before = str(Path(args.before).resolve())
    if args.memory_requests is None:
        args.memory_requests = 20_000 if args.quick else 100_000
    import uvloop

    os.environ.setdefault("PYTHONHASHSEED", "0")
    uvloop.run(run(args))


if __name__ == "__main__":
    main()
