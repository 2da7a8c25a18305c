"""Plan latency for a 500-node fleet: the pure planner locally, and `ctl model plan` over NATS.

Starts an embedded nats-server, publishes 500 simulated inventories, runs
`llmgw planner` as its own process, and times plan requests from this one
(the model config is cached by the planner after the first request).

    .venv/bin/python benchmarks/plan.py [--nodes 500] [--requests 300]
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
from pathlib import Path

from llmgw import fleetfile
from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.bus.server import EmbeddedServer
from llmgw.cli.nats_cmd import declare_streams
from llmgw.config import Settings
from llmgw.fleet.state import fold
from llmgw.planner import candidates as planner
from llmgw.planner import modelinfo
from llmgw.planner.service import ask

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "examples" / "models"
CLASSES = (("H100-80GB", 81559, 8), ("A100-40GB", 40960, 8), ("L40S-48GB", 46068, 4), ("H200-141GB", 143771, 8))
MODELS_ASKED = ("meta-llama/Llama-3.3-70B-Instruct", "Qwen/Qwen2.5-14B-Instruct", "deepseek-ai/DeepSeek-V3")


def fleet_toml(nodes: int) -> str:
    """A mixed fleet: four classes, 25-node fabrics, one bad GPU in every tenth node."""
    out = []
    for i in range(nodes):
        cls, mem, count = CLASSES[i % len(CLASSES)]
        bad = "\nunhealthy = [0]" if i % 10 == 0 else ""
        out.append(f'[[nodes]]\nname = "n{i:04d}"\nfabric = "f{i // 25:02d}"\ngpu_class = "{cls}"\n'
                   f"gpu_count = {count}\ngpu_memory_mib = {mem}{bad}\n")
    return "\n".join(out)


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000


def report(label: str, samples: list[float]) -> None:
    print(f"{label:<48} p50 {pct(samples, 0.5):7.2f} ms   p99 {pct(samples, 0.99):7.2f} ms   "
          f"mean {statistics.fmean(samples) * 1000:7.2f} ms   n={len(samples)}")


def bench_local(fleet: fleetfile.Fleet, requests: int) -> None:
    state = fold(fleetfile.inventories(fleet, m.utcnow()))
    samples = []
    for _ in range(requests):
        t = time.perf_counter()
        pools = planner.pools(state)
        samples.append(time.perf_counter() - t)
    report("local  pools() of the fold (once per fleet change)", samples)
    for name in MODELS_ASKED:
        info = modelinfo.load(name, models_dir_=MODELS)
        req = m.PlanRequest(model=name)
        planner.plan(info, state, req)  # warm the per-model tensor cache
        samples = []
        for _ in range(requests):
            t = time.perf_counter()
            reply = planner.plan(info, state, req, fleet_pools=pools)
            samples.append(time.perf_counter() - t)
        report(f"local  {name} ({len(reply.candidates)} candidates)", samples)


def start_planner(url: str) -> subprocess.Popen[bytes]:
    """`llmgw planner` as its own process, as in production."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "llmgw", "planner",
                             "--nats-url", url, "--models-dir", str(MODELS)], env=env)


async def bench_nats(fleet: fleetfile.Fleet, requests: int, url: str) -> None:
    bus = await Bus.connect(Settings(nats_url=url), "bench-plan", reconnect=False)
    t = time.perf_counter()
    await bus.publish_many(fleetfile.inventories(fleet, m.utcnow()))
    print(f"published {len(fleet.nodes)} inventories in {time.perf_counter() - t:.2f} s")
    try:
        want = sum(n.gpu_count - len(n.unhealthy) for n in fleet.nodes)
        deadline = time.monotonic() + 60
        while True:
            try:
                reply = await ask(bus, m.PlanRequest(model=MODELS_ASKED[0]), timeout=5)
                if reply.fleet_gpus == want:
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the planner did not come up with the whole fleet within 60 s")
            await asyncio.sleep(0.2)
        for name in MODELS_ASKED:
            await ask(bus, m.PlanRequest(model=name))  # the planner caches the model's config
            samples = []
            for _ in range(requests):
                t = time.perf_counter()
                reply = await ask(bus, m.PlanRequest(model=name))
                samples.append(time.perf_counter() - t)
            report(f"nats   {name} ({len(reply.candidates)} candidates)", samples)
    finally:
        await bus.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument("--requests", type=int, default=300)
    args = ap.parse_args()
    fleet = fleetfile.parse(fleet_toml(args.nodes), "<bench>")
    print(f"fleet: {args.nodes} nodes, {sum(n.gpu_count for n in fleet.nodes)} GPUs, "
          f"{len({n.fabric for n in fleet.nodes})} fabrics, {len(CLASSES)} classes")
    bench_local(fleet, args.requests)
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-plan-") as d, EmbeddedServer(Path(d), port=0) as server:
        asyncio.run(declare_streams(server.url))
        proc = start_planner(server.url)
        try:
            asyncio.run(bench_nats(fleet, args.requests, server.url))
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
