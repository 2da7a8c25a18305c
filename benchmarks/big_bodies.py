"""A small request's latency while other clients send big bodies: idle, and under four of them.

    python benchmarks/big_bodies.py [--mb 27] [--clients 4] [--probes 300] [--text mixed|ascii] [--no-stream]
                                    [--router-path DIR]

Issue 45: four clients sending 27 MB bodies moved everyone else's median from 2.5 ms to
175 ms. Starts a nats-server, a sink engine (aiohttp, takes any body, answers a fixed chat
completion with usage: no engine work to hide the router's) and a router, as separate
processes. A probe sends one short chat request at a time: first with nothing else running,
then while ``--clients`` clients each send ``--mb`` MB chat bodies back to back (the prompt
in one message). The same two runs go straight to the sink, which is this box's floor: what
any proxy in front of it could reach at best. ``--router-path`` runs the router from another
checkout (``git worktree add --detach /tmp/before main``) for the figures before a change.
``--parse-costs`` prints only the router's own work on one body (its head, its routing key,
the usage asked for, a llama.cpp replica's ``lora``), for this checkout or ``--router-path``.
Latency on a shared box is noisy; the on-CPU time per big body of the process that serves
it (the sink straight, the router through it) is the steadier figure.
Prints a markdown table; docs/benchmarks.md keeps the figures.
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
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.bus.server import EmbeddedServer

HERE = str(Path(__file__).resolve())
ANSWER = (b'{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant",'
          b'"content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}')


def sink_main() -> None:
    """An engine that reads any body and answers at once."""
    import uvloop
    from aiohttp import web

    async def main() -> None:
        async def handle(request: web.Request) -> web.Response:
            await request.read()
            return web.Response(body=ANSWER, content_type="application/json")

        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", flush=True)  # type: ignore[union-attr]
        await asyncio.Event().wait()

    uvloop.run(main())


def parse_costs_main(mb: int) -> None:
    """The router's own work on one body, in ms (min of 5): read its head, its routing key, ask for usage,
    set a llama.cpp replica's ``lora``. Runs whichever llmgw is first on the path (``--router-path``)."""
    import json

    n = mb * 1_000_000
    shapes = {
        f"{mb} MB ASCII prompt": json.dumps({"model": "m", "stream": True, "messages": [
            {"role": "system", "content": "the quick brown fox " * (n // 20)}, {"role": "user", "content": "hi"}]}),
        f"{mb} MB prompt, quotes and umlauts": json.dumps({"model": "m", "stream": True, "messages": [
            {"role": "system", "content": 'der "Hund" über\n' * (n // 18)}]}, ensure_ascii=False),
        f"{n // 270:,} messages": json.dumps({"model": "m", "stream": True, "messages": [
            {"role": "user", "content": "hello there " * 20}] * (n // 270)}),
    }
    print("| body | head | key | usage asked | lora set | total |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, text in shapes.items():
        row = [best_ms(step) for step in steps(text.encode())]
        print(f"| {name} | " + " | ".join(f"{x:.1f}" for x in row) + f" | {sum(row):.1f} |", flush=True)


def steps(body: bytes) -> list[Callable[[], object]]:
    """Head, key, usage asked, lora set: as the gateway calls each (an older checkout's own way)."""
    from llmgw.router import adapters
    from llmgw.router import openai_api as api
    from llmgw.router import prefix as pr

    head = api.HEAD.decode(body)
    sent = getattr(head, "sent_lora", None)  # None: a checkout from before the one read
    return [
        lambda: api.HEAD.decode(body),
        lambda: pr.prompt_key("/v1/chat/completions", body if sent is None else head),
        lambda: api.usage_asked(body, head),
        (lambda: adapters.lora_body(body, ("a", "b"), "a", 1.0)) if sent is None
        else (lambda: adapters.lora_body(body, ("a", "b"), "a", 1.0, sent())),  # type: ignore[call-arg]
    ]


def best_ms(step: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def start(cmd: list[str], env: dict[str, str] | None = None,
          cwd: str | None = None) -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, cwd=cwd)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    if not line.startswith("http"):
        proc.kill()
        raise SystemExit(f"{cmd[:4]} did not start (exit {proc.wait()})")
    return proc, line


async def timed_post(session: aiohttp.ClientSession, url: str, body: bytes, who: str) -> float:
    """One chat request with ``body``, answered in full; seconds it took (a non-200 ends the run)."""
    t0 = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", data=body,
                            headers={"Content-Type": "application/json"}) as resp:
        answer = await resp.read()
        if resp.status != 200:
            raise SystemExit(f"{who}: HTTP {resp.status}: {answer[:200]!r}")
    return time.perf_counter() - t0


async def probe(session: aiohttp.ClientSession, url: str, n: int) -> list[float]:
    body = m.ENCODER.encode({"model": "m", "messages": [{"role": "user", "content": "hello"}]})
    out: list[float] = []
    for _ in range(n):
        out.append(await timed_post(session, url, body, "probe"))
        await asyncio.sleep(0.002)  # a client that waits between requests, not a closed loop
    return out


async def big_client(session: aiohttp.ClientSession, url: str, body: bytes, stop: asyncio.Event,
                     times: list[float]) -> None:
    while not stop.is_set():
        times.append(await timed_post(session, url, body, "big body"))


async def measure(url: str, args: argparse.Namespace, big: bytes,
                  pid: int) -> tuple[list[float], list[float], list[float], float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await probe(session, url, 30)  # warm
        idle = await probe(session, url, args.probes)
        stop, times = asyncio.Event(), []
        cpu0 = cpu_ns(pid)
        clients = [asyncio.create_task(big_client(session, url, big, stop, times)) for _ in range(args.clients)]
        await asyncio.sleep(1.0)
        loaded = await probe(session, url, args.probes)
        stop.set()
        await asyncio.gather(*clients)
        cpu = (cpu_ns(pid) - cpu0) / 1e6
    return idle, loaded, times, cpu / max(1, len(times))


def cpu_ns(pid: int) -> int:
    """On-CPU nanoseconds of every thread of a process so far."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError):
            pass
    return total


def ms(xs: list[float], q: float) -> str:
    xs = sorted(xs)
    return f"{xs[min(len(xs) - 1, int(len(xs) * q))] * 1000:.1f}"


async def run(args: argparse.Namespace) -> None:
    store = Path(tempfile.mkdtemp(prefix="llmgw-bench-bodies-"))
    server = EmbeddedServer(store, port=0).start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        sink, sink_url = start([sys.executable, HERE, "--sink"])
        procs.append(sink)
        async with await Bus.connect(__import__("llmgw.config").config.Settings(nats_url=server.url), "bench") as bus:
            await bus.ensure_streams()
            spec = m.ModelSpec(name="m", source="x", precision="bf16", engine="vllm", gpu_class="H100", context=4096)
            await bus.publish(m.ReplicaPlaced(at=datetime.now(UTC), replica_id="r1", model="m", nodes=("bench",),
                                              gpus=(m.GpuRef(node="bench", index=0, uuid="GPU-r1"),), spec=spec))
            await bus.publish(m.ReplicaStateChanged(at=datetime.now(UTC), replica_id="r1", model="m", node="bench",
                                                    state="healthy", endpoint=sink_url))
        env = dict(os.environ)
        if args.router_path:
            env["PYTHONPATH"] = args.router_path
        router, router_url = start([sys.executable, "-m", "llmgw", "router", "--listen", "127.0.0.1:0",
                                    "--nats-url", server.url, "--name", "bench-bodies", "--max-body", "256MiB"], env,
                              # `python -m` puts its working directory first on the path, before PYTHONPATH
                              cwd=args.router_path or None)
        procs.append(router)
        async with aiohttp.ClientSession() as s:
            for _ in range(100):
                async with s.get(router_url + "/health") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.1)
        unit = 'the "quick" brown fox — über den faulen Hund\n' if args.text == "mixed" else "the quick brown fox jumps "
        text = unit * (args.mb * 1_000_000 // len(unit.encode()))
        big = m.ENCODER.encode({"model": "m", "stream": args.stream, "messages": [
            {"role": "system", "content": text}, {"role": "user", "content": "summarize"}]})
        print(f"big body: {len(big) / 1e6:.1f} MB, {args.text} text, stream {args.stream}; {args.clients} clients; "
              f"{args.probes} probes; "
              f"router from {args.router_path or 'this checkout'}", flush=True)
        rows = []
        for target, url, pid in (("straight to the engine", sink_url, sink.pid),
                                 ("through the router", router_url, router.pid)):
            idle, loaded, times, cpu = await measure(url, args, big, pid)
            rows.append((target, ms(idle, 0.5), ms(idle, 0.99), ms(loaded, 0.5), ms(loaded, 0.99),
                         f"{statistics.median(loaded) / statistics.median(idle):.1f}",
                         f"{statistics.median(times) * 1000:.0f}" if times else "-", f"{cpu:.0f}"))
            print(" | ".join(rows[-1]), flush=True)
        print()
        print("| target | idle p50 ms | idle p99 ms | under big bodies p50 ms | p99 ms | × idle p50 "
              "| a big body's p50 ms | CPU ms per big body (the engine's; the router's) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
        print(f"\nload average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--mb", type=int, default=27)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--probes", type=int, default=300)
    ap.add_argument("--text", choices=("mixed", "ascii"), default="mixed",
                    help="mixed: quotes, a dash, umlauts and newlines, which JSON escapes; ascii: none")
    ap.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                    help="big bodies ask for a stream (the router then asks the engine for its usage)")
    ap.add_argument("--router-path", default="", help="run the router from this checkout (PYTHONPATH)")
    ap.add_argument("--parse-costs", action="store_true",
                    help="only the router's own work on one body (head, key, usage, lora), no processes")
    ap.add_argument("--sink", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sink:
        sink_main()
        return
    if args.parse_costs:
        if args.router_path:
            sys.exit(subprocess.call([sys.executable, HERE, "--parse-costs", "--mb", str(args.mb)],
                                     env={**os.environ, "PYTHONPATH": args.router_path}))
        parse_costs_main(args.mb)
        return
    import uvloop

    uvloop.run(run(args))


if __name__ == "__main__":
    main()
