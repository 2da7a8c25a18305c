"""LoRA adapters through the router: where requests land, and what a load costs the request that waits for it.

    python benchmarks/adapters.py [--requests 10000] [--clients 16] [--adapters 8] [--load-ms 200]

Two fake engines holding adapters as vLLM does (``--max-loras 2``, each load taking
``--load-ms``, its least recently used dropped at the limit), an in-process router on an
embedded nats-server, a base model declared with ``max_adapters`` 2 and ``--adapters``
adapters; ``--clients`` streaming clients send ``--requests`` chat requests whose adapter
is drawn from a skewed mix (Zipf, s = 1.1: a few adapters hot, the rest cold).

Printed: requests that reached a replica without their adapter (the engine's 404, which the
router counts; the goal is 0), the share that landed on a replica already holding their
adapter (no load waited for; goal ≥ 95 %), and for the requests that waited for a load, the
time to first token less the load it waited for (the router's ``x-llmgw-adapter-load-ms``: the
engine's answer to the load call; goal ≤ 50 ms), p50/p95. Loads and
unloads the router made, and the engines' own counts beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.bus.server import EmbeddedServer
from llmgw.config import Settings
from llmgw.engine.fake import spawn
from llmgw.router.server import Router


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--slots", type=int, default=2, help="adapters one replica holds at once (--max-loras)")
    ap.add_argument("--load-ms", type=float, default=200.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-adapters-"))
    server = EmbeddedServer(tmp / "nats", port=0).start()
    # --max-cpu-loras as the agent starts vLLM (engine_argv: two cached weights per slot).
    engines = [spawn("base", "--max-loras", str(args.slots), "--max-cpu-loras", str(2 * args.slots),
                     "--lora-load-ms", str(args.load_ms), "--chunks", "2",
                     name=f"base-r{i}") for i in (1, 2)]
    try:
        async with await Bus.connect(Settings(nats_url=server.url), "bench-adapters") as bus:
            await bus.ensure_streams()
            await run(bus, args, [e.url for e in engines])
    finally:
        for e in engines:
            e.stop()
        server.stop()


async def run(bus: Bus, args: argparse.Namespace, urls: list[str]) -> None:
    now = datetime.now(UTC)
    spec = m.ModelSpec(name="base", source="./base", precision="bf16", engine="vllm", gpu_class="L4-24GB",
                       context=2048, max_adapters=args.slots, max_lora_rank=16)
    names = [f"a{i}" for i in range(args.adapters)]
    await bus.publish(m.ModelDeclared(at=now, spec=spec))
    for name in names:
        await bus.publish(m.AdapterDeclared(at=now, spec=m.AdapterSpec(
            name=name, base="base", source=name, path=f"/adapters/{name}", format="peft", rank=8, alpha=16)))
    for i, url in enumerate(urls, 1):
        await bus.publish(m.ReplicaPlaced(at=now, replica_id=f"base-r{i}", model="base", nodes=("n1",), spec=spec,
                                          gpus=(), fabric="f"))
        await bus.publish(m.ReplicaStateChanged(at=now, replica_id=f"base-r{i}", model="base", node="n1",
                                                state="healthy", endpoint=url))
    router = Router(bus, "bench-adapters", tick_s=3600)
    await router.start("127.0.0.1", 0)
    try:
        await router.sink.wait_for(lambda pool: len(pool.healthy.get("base", ())) == 2 and len(pool.adapters) == len(names))
        rng = random.Random(args.seed)
        weights = [1 / (k + 1) ** 1.1 for k in range(len(names))]
        mix = rng.choices(names, weights, k=args.requests)
        gw = router.gateway.adapters
        waited: list[float] = []  # TTFT less the engine's load, for requests that waited for a load
        hits = 0
        queue: asyncio.Queue[str] = asyncio.Queue()
        for name in mix:
            queue.put_nowait(name)

        async def client(session: aiohttp.ClientSession) -> None:
            nonlocal hits
            while not queue.empty():
                name = queue.get_nowait()
                held = any(name in h for h in gw.held.values())  # no load to wait for
                t0 = time.perf_counter()
                body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "stream": True}
                async with session.post(router.url + "/v1/chat/completions", json=body) as resp:
                    await resp.content.readany()
                    ttft = time.perf_counter() - t0
                    load_s = float(resp.headers.get("x-llmgw-adapter-load-ms", "0")) / 1000
                    async for _ in resp.content.iter_any():
                        pass
                    assert resp.status == 200, resp.status
                if held:
                    hits += 1
                elif load_s:  # the request that made its adapter's load: the load's own time off
                    waited.append(ttft - load_s)

        t0 = time.perf_counter()
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(client(session) for _ in range(args.clients)))
        took = time.perf_counter() - t0
        stats = []
        async with aiohttp.ClientSession() as session:
            for url in urls:
                async with session.get(url + "/stats") as r:
                    stats.append(json.loads(await r.text()))
        print(f"{args.requests:,} requests, {args.clients} clients, {len(names)} adapters (Zipf 1.1), 2 replicas x "
              f"{args.slots} slots, load {args.load_ms:g} ms; {args.requests / took:,.0f} req/s")
        print(f"  reached a replica without their adapter: {gw.missing}")
        print(f"  landed on a replica already holding it:  {hits / args.requests:.2%}")
        print(f"  made a load: {len(waited)}; TTFT less the load's own time: p50 "
              f"{pct(waited, 0.5) * 1000:.1f} ms, p95 {pct(waited, 0.95) * 1000:.1f} ms"
              + (f", mean {statistics.fmean(waited) * 1000:.1f} ms" if waited else ""))
        print(f"  router loads {gw.loads}, unloads {gw.unloads}; engines' loads "
              f"{[s['loads'] for s in stats]}, reloads {[s['reloads'] for s in stats]}")
    finally:
        with contextlib.suppress(Exception):
            await router.stop()


if __name__ == "__main__":
    asyncio.run(main())
