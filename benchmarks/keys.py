"""API keys as events: what they cost a router per request, and how soon a revocation is seen.

    python benchmarks/keys.py [--keys 10000] [--requests 3000] [--revocations 20]

1. **Per-request cost.** One ``llmgw router`` process in front of an instant fake engine,
   10,000 keys declared on the bus (each with a requests-per-minute and a tokens-per-day
   limit), one of them used: the router's own CPU (from /proc) per request, against the same
   router run with ``--api-keys FILE`` (one digest, the static fallback) and with no keys at
   all, alternating, in one run. Also its resident memory with the keys folded.
2. **Revocation.** Three router processes; a key is declared, used on all three, revoked; the
   time from the revocation's publish to each router's first 401 (polled every 10 ms), over
   20 revocations: median and max.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from llmgw import ctl
from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.bus.server import EmbeddedServer, free_port
from llmgw.config import Settings
from llmgw.engine.fake import spawn

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def start_router(name: str, url: str, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llmgw", "router", "--listen", f"127.0.0.1:{port}", "--name", name,
                             "--nats-url", url, "--tick", "3600", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    proc.stdout.readline()  # its URL: it is caught up and listening
    return proc, f"http://127.0.0.1:{port}"


def key(name: str, **kw: object) -> tuple[str, m.KeyDeclared]:
    secret, key_id, salt, digest = ctl.new_key_secret()
    return secret, m.KeyDeclared(at=datetime.now(UTC), name=name, lookup_id=key_id, salt=salt, digest=digest,
                                 **kw)  # type: ignore[arg-type]


async def serve_bench(bus: Bus, endpoint: str) -> None:
    """Streams declared, and model ``bench`` served by one healthy replica at ``endpoint``."""
    spec = m.ModelSpec(name="bench", source="x", precision="bf16", engine="vllm", gpu_class="H100", context=4096)
    await bus.ensure_streams()
    await bus.publish(m.ModelDeclared(at=datetime.now(UTC), spec=spec))
    await bus.publish(m.ReplicaPlaced(at=datetime.now(UTC), replica_id="r1", model="bench", nodes=("n",),
                                      gpus=(m.GpuRef(node="n", index=0, uuid="GPU-1"),), spec=spec))
    await bus.publish(m.ReplicaStateChanged(at=datetime.now(UTC), replica_id="r1", model="bench", node="n",
                                            state="healthy", endpoint=endpoint))


async def load(http: aiohttp.ClientSession, url: str, secret: str | None, n: int) -> None:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    body = {"model": "bench", "messages": [{"role": "user", "content": "hi"}]}
    sem = asyncio.Semaphore(16)

    async def one() -> None:
        async with sem, http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200, (r.status, await r.text())

    await asyncio.gather(*(one() for _ in range(n)))


async def until(http: aiohttp.ClientSession, url: str, secret: str, want: int, limit_s: float = 30.0) -> float:
    t0 = time.monotonic()
    body = {"model": "bench", "messages": [{"role": "user", "content": "hi"}]}
    while True:
        async with http.post(url + "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {secret}"}) as r:
            if r.status == want:
                return time.monotonic() - t0
        if time.monotonic() - t0 > limit_s:
            raise SystemExit(f"{url} never answered {want}")
        await asyncio.sleep(0.01)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--revocations", type=int, default=20)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-keys-"))
    engine = spawn("bench", name="E")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # Part 1: per-request cost. Static and anonymous routers on a bus with no keys; the keyed one on its own.
        plain = EmbeddedServer(tmp / "plain", port=0).start()
        keyed = EmbeddedServer(tmp / "keyed", port=0).start()
        static_secret = "static-secret-for-the-benchmark"
        digests = tmp / "keys.sha256"
        digests.write_text(hashlib.sha256(static_secret.encode()).hexdigest() + "\n")
        used, used_key = key("used", requests_per_minute=10**9, tokens_per_day=10**12)
        for server, keys in ((plain, False), (keyed, True)):
            async with await Bus.connect(Settings(nats_url=server.url), "bench-keys") as bus:
                await serve_bench(bus, engine.url)
                if keys:
                    t0 = time.perf_counter()
                    await bus.publish_many([key(f"k{i}", requests_per_minute=600, tokens_per_day=10**6)[1]
                                            for i in range(args.keys - 1)] + [used_key])
                    print(f"{args.keys:,} keys published in {time.perf_counter() - t0:.1f} s")
        routers = {"no keys": start_router("anon", plain.url),
                   "--api-keys FILE (1 digest)": start_router("static", plain.url, "--api-keys", str(digests)),
                   f"{args.keys:,} keys on the bus, limits on": start_router("keyed", keyed.url)}
        procs += [p for p, _ in routers.values()]
        secrets = {"no keys": None, "--api-keys FILE (1 digest)": static_secret,
                   f"{args.keys:,} keys on the bus, limits on": used}
        per: dict[str, list[float]] = {name: [] for name in routers}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            for name, (_, url) in routers.items():
                await load(http, url, secrets[name], 200)  # warm
            for rnd in range(args.rounds):
                names = list(routers)
                for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                    proc, url = routers[name]
                    before = cpu_s(proc.pid)
                    await load(http, url, secrets[name], args.requests)
                    per[name].append((cpu_s(proc.pid) - before) / args.requests * 1e6)
        base = statistics.median(per["--api-keys FILE (1 digest)"])
        print(f"\nrouter CPU per request, median of {args.rounds} rounds of {args.requests} (alternating):")
        for name, xs in per.items():
            proc, _ = routers[name]
            print(f"  {name:38} {statistics.median(xs):7.0f} µs  ({statistics.median(xs) / base:.2f}× the static file)"
                  f"   RSS {rss_mib(proc.pid):.0f} MiB")
        for p in procs:
            p.terminate()
            p.wait(10)
        procs.clear()
        plain.stop()
        keyed.stop()

        # Part 2: revocation seen by three routers.
        server = EmbeddedServer(tmp / "revoke", port=0).start()
        async with await Bus.connect(Settings(nats_url=server.url), "bench-revoke") as bus:
            await serve_bench(bus, engine.url)
            three = [start_router(f"r{i}", server.url) for i in range(3)]
            procs += [p for p, _ in three]
            seen: list[float] = []
            async with aiohttp.ClientSession() as http:
                for i in range(args.revocations):
                    secret, k = key(f"rev{i}")
                    await bus.publish(k)
                    for _, url in three:
                        await until(http, url, secret, 200)
                    t0 = time.monotonic()
                    await bus.publish(m.KeyRevoked(at=datetime.now(UTC), name=f"rev{i}"))
                    published = time.monotonic() - t0
                    waits = await asyncio.gather(*(until(http, url, secret, 401) for _, url in three))
                    seen += [published + w for w in waits]
        server.stop()
        print(f"\nrevocation seen by 3 routers ({args.revocations} revocations, {len(seen)} answers): median "
              f"{statistics.median(seen) * 1000:.0f} ms, max {max(seen) * 1000:.0f} ms (polling every 10 ms)")
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        engine.stop()


if __name__ == "__main__":
    asyncio.run(main())
