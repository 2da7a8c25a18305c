"""Prefix-aware routing against the real llama-server: cached share, TTFT and balance per policy.

    python benchmarks/prefix.py [--rounds 3] [--requests 200] [--clients 4] [--slots 8] [--scenarios shared,random,skewed]

Three llama-servers (scripts/llama-server.sh) on the demo model at ``--layers 4 --embd 256
--context 4096``, each ``--parallel 8`` slots with llama.cpp's host-memory prompt cache off
(``--cache-ram 0``), so a replica caches only as many prefixes as it has slots, as a GPU's KV
cache holds only so many; one thread each. An in-process router (llmgw.router.Router, on an
embedded nats-server) routes a model declared with each policy in turn; the engines are
started afresh for every run, so no run inherits another's cache. Streaming clients send
chat requests (a ~2,000-token system prompt, a short user line, 4 tokens out) and time the
first byte. Scenarios (issue 27):

* shared: 12 system prompts, picked at random per request; mean TTFT over the last half.
* random: every prompt different, of the same length; p99 TTFT.
* skewed: half the requests share one prompt, the rest the other 11; each replica's share.

The engines' cached share is theirs: llama-server's ``timings.cache_n`` over ``prompt_tokens``
in the usage each answer carries. Figures print as a table; docs/benchmarks.md keeps them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.bus.server import EmbeddedServer, free_port
from llmgw.config import Settings
from llmgw.engine.demomodel import write_demo_model
from llmgw.router.metrics import usage_of_stream
from llmgw.router.server import Router

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the", "tool", "returns", "json", "with", "fields", "user", "answer", "must", "never", "call", "when",
         "a", "schema", "agent", "reply", "system", "format", "each", "step", "list", "value", "error")


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Run:
    policy: str
    ttft: list[float] = field(default_factory=list)
    replicas: Counter[str] = field(default_factory=Counter)
    prompt: int = 0
    cached: int = 0
    seconds: float = 0.0
    failed: int = 0


def binary() -> str:
    given = os.environ.get("LLMGW_LLAMA_SERVER")
    if given and os.access(given, os.X_OK):
        return given
    built = subprocess.run(["bash", str(ROOT / "scripts" / "llama-server.sh")], capture_output=True, text=True,
                           check=False)
    if built.returncode:
        sys.exit(f"scripts/llama-server.sh failed:\n{built.stdout}{built.stderr}")
    return built.stdout.strip().splitlines()[-1]


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _tail(log: Path) -> str:
    return log.read_text()[-3000:]


async def start_engine(exe: str, gguf: Path, slots: int, context: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [exe, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-np", str(slots),
           "-c", str(slots * context), "--cache-ram", "0"]
    proc = _spawn(cmd, log)
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        for _ in range(600):
            if proc.poll() is not None:
                sys.exit(f"llama-server exited {proc.returncode}:\n{_tail(log)}")
            try:
                async with http.get(url + "/health") as r:
                    if r.status == 200:
                        return proc, url
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    sys.exit(f"llama-server not ready within 60 s:\n{_tail(log)}")


async def one(http: aiohttp.ClientSession, url: str, model: str, system: str, user: str, run: Run,
              record: bool) -> None:
    body = {"model": model, "stream": True, "max_tokens": 4, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    t0 = time.perf_counter()
    first = None
    chunks: list[bytes] = []
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            run.failed += 1
            return
        async for chunk in resp.content.iter_any():
            if first is None:
                first = time.perf_counter() - t0
            chunks.append(chunk)
        rep = resp.headers.get("x-llmgw-replica", "?")
    usage = usage_of_stream(b"".join(chunks)[-65536:])
    if record:
        run.ttft.append(first or 0.0)
        run.replicas[rep] += 1
        if usage is not None:
            run.prompt += usage.prompt_tokens
            run.cached += usage.cached_tokens


async def scenario(name: str, policy: str, args: argparse.Namespace, exe: str, gguf: Path, tmp: Path,
                   settings: Settings) -> Run:
    rng = random.Random(args.seed)
    prompts = [text(rng, args.prompt_words) for _ in range(12)]
    engines = [await start_engine(exe, gguf, args.slots, args.context, tmp / f"{name}-{policy}-{i}.log")
               for i in range(3)]
    model = f"demo-{name}-{policy}"
    router = None
    try:
        async with await Bus.connect(settings, "bench-prefix") as bus:
            spec = m.ModelSpec(name=model, source=str(gguf), precision="q8_0", engine="llama.cpp", gpu_class="CPU",
                               context=args.context, routing=policy)  # type: ignore[arg-type]
            await bus.publish(m.ModelDeclared(at=datetime.now(UTC), spec=spec))
            for i, (_, url) in enumerate(engines):
                rid = f"{model}-r{i}"
                await bus.publish(m.ReplicaPlaced(at=datetime.now(UTC), replica_id=rid, model=model, nodes=("bench",),
                                                  gpus=(m.GpuRef(node="bench", index=i, uuid=f"GPU-{rid}"),), spec=spec))
                await bus.publish(m.ReplicaStateChanged(at=datetime.now(UTC), replica_id=rid, model=model,
                                                        node="bench", state="healthy", endpoint=url))
            router = Router(bus, f"bench-{name}-{policy}", tick_s=3600)
            await router.start("127.0.0.1", 0)
            await router.sink.wait_for(lambda p: len(p.healthy.get(model, [])) == 3)
            run = Run(policy)
            n = args.requests
            jobs: asyncio.Queue[tuple[int, str, str]] = asyncio.Queue()
            for i in range(n):
                if name == "random":
                    system = text(rng, args.prompt_words)
                elif name == "skewed":
                    system = prompts[0] if rng.random() < 0.5 else prompts[rng.randrange(1, 12)]
                else:
                    system = prompts[rng.randrange(12)]
                jobs.put_nowait((i, system, f"question {i}: {text(rng, 6)}"))
            # The last half is measured (shared, skewed: after the caches warm; random: the same half).
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as http:
                async def client() -> None:
                    while not jobs.empty():
                        i, system, user = jobs.get_nowait()
                        await one(http, router.url, model, system, user, run, i >= n // 2)  # type: ignore[union-attr]

                t0 = time.perf_counter()
                await asyncio.gather(*(client() for _ in range(args.clients)))
                run.seconds = time.perf_counter() - t0
            return run
    finally:
        if router is not None:
            await router.stop()
        for proc, _ in engines:
            proc.terminate()
            proc.wait(timeout=10)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prompt-words", type=int, default=620, help="words in a system prompt (~2,000 tokens)")
    ap.add_argument("--scenarios", default="shared,random,skewed")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1, help="each scenario this often, the policies' order alternating")
    args = ap.parse_args()
    exe = binary()
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-prefix-"))
    demo = write_demo_model(tmp / "model", context=args.context, layers=4, embd=256)
    server = EmbeddedServer(tmp / "nats", port=0).start()
    settings = Settings(nats_url=server.url)
    try:
        async with await Bus.connect(settings, "bench-prefix") as bus:
            await bus.ensure_streams()
        print(f"llama-server {exe}; demo model {demo.params:,} parameters; 3 engines x {args.slots} slots, "
              f"--cache-ram 0, one thread each; {args.requests} requests, {args.clients} streaming clients; "
              "figures over the last half")
        print(f"{'scenario':8} {'policy':18} {'mean TTFT ms':>12} {'p50':>7} {'p99':>7} {'req/s':>6} "
              f"{'cached':>7} {'busiest/mean':>12} {'failed':>6}")
        ratios: dict[str, list[tuple[float, float, float]]] = {}
        for rnd in range(args.rounds):
            for name in args.scenarios.split(","):
                runs = {}
                # Alternating which policy runs first, so neither always meets the quieter machine.
                order = ("least-outstanding", "prefix") if rnd % 2 == 0 else ("prefix", "least-outstanding")
                for policy in order:
                    run = await scenario(name, policy, args, exe, demo.gguf, tmp, settings)
                    runs[policy] = run
                    share = max(run.replicas.values()) / (sum(run.replicas.values()) / 3) if run.replicas else 0
                    print(f"{name:8} {policy:18} {statistics.fmean(run.ttft) * 1000:12.0f} "
                          f"{pct(run.ttft, 0.5) * 1000:7.0f} {pct(run.ttft, 0.99) * 1000:7.0f} "
                          f"{args.requests / run.seconds:6.2f} {run.cached / max(run.prompt, 1):7.1%} {share:12.2f} "
                          f"{run.failed:6d}", flush=True)
                lo, px = runs["least-outstanding"], runs["prefix"]
                r = (statistics.fmean(lo.ttft) / statistics.fmean(px.ttft), pct(px.ttft, 0.99) / pct(lo.ttft, 0.99),
                     lo.seconds / px.seconds)
                ratios.setdefault(name, []).append(r)
                print(f"{name:8} round {rnd + 1}, prefix vs least-outstanding: mean TTFT x{r[0]:.2f} lower, p99 ratio "
                      f"{r[1]:.2f}, throughput x{r[2]:.2f}", flush=True)
        for name, rs in ratios.items():
            print(f"{name:8} median of {len(rs)} rounds: mean TTFT x{statistics.median(x[0] for x in rs):.2f} lower, "
                  f"p99 ratio {statistics.median(x[1] for x in rs):.2f}, throughput "
                  f"x{statistics.median(x[2] for x in rs):.2f}", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    asyncio.run(main())
