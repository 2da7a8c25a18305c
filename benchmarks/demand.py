"""The demand loop on real processes: how long a parked model takes to answer, and how load scales it.

    python benchmarks/demand.py [--rounds 5] [--startup-s 2] [--skip-scale]
    python benchmarks/demand.py --engine real [--rounds 5]

``llmgw up`` (NATS, projector, planner, scheduler, router) and one simulated agent
whose fake engines take ``--startup-s`` to start (like an engine loading weights)
and 200 ms per reply.

* wake: a model with a 1 s idle TTL is left until the scheduler parks it, then one
  streamed request goes through the router. Time to first byte, and what is left of
  it once the engine's own start-up is taken away (placement + agent start + health
  check + router notice), split by the events' own timestamps.
* scale: a model autoscaled 1..16 with a target of 4 in flight per replica, and 64
  clients sending back to back: router ticks until the replicas the target asks for
  (64 / 4 = 16) are placed and healthy, changes of the count over the next 60 ticks
  (0 is no flapping), and ticks until quiet takes it back to its minimum.

``--engine real``: llama.cpp's llama-server (scripts/llama-server.sh) on the demo model
(``llmgw demo-model --layers 4 --embd 256``) under ``up --simulate examples/cpu.toml
--engines real``. The engine's own start-up (spawn → /health and a one-token completion
answer) is measured alone first, so the wake's overhead is what llmgw adds to it. Then the
router's overhead: the same requests sent straight to the engine and through the router,
alternating, in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from control_loop import (  # the same CLI and event helpers, side by side in benchmarks/
    at,
    cli,
    events,
)

LLMGW = str(Path(sys.executable).parent / "llmgw")
MODEL = "Qwen/Qwen2.5-14B-Instruct"
TICK_S = 0.5
FLEET = """
[[nodes]]
name = "gpu-a"
fabric = "ib-a"
gpu_class = "A100-40GB"
gpu_count = 8
gpu_memory_mib = 40960

[[nodes]]
name = "gpu-b"
fabric = "ib-a"
gpu_class = "A100-40GB"
gpu_count = 8
gpu_memory_mib = 40960
"""


def until(what: str, pred: Any, within_s: float = 120, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if got := pred():
                return got
        except subprocess.CalledProcessError:
            pass  # a part still starting (the projector answers status once it has caught up)
        time.sleep(every_s)
    raise SystemExit(f"timed out waiting for {what}")


def model_state(url: str, name: str) -> str:
    rows = json.loads(cli(url, "ctl", "model", "list", "--json"))
    return next((r["state"] for r in rows if r["name"] == name), "")


async def first_byte(base: str, model: str) -> float:
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        async with s.post(base + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=180)) as r:
            assert r.status == 200, await r.text()
            await r.content.readany()
            ttfb = time.monotonic() - t0
            await r.read()
    return ttfb


def wake(url: str, base: str, rounds: int, startup_s: float, model: str = MODEL,
         plan: tuple[str, ...] = ("--from-plan", "--precision", "bf16", "--tp", "1", "--context", "8192"),
         engine: str = "fake engine") -> None:
    cli(url, "ctl", "model", "deploy", "sleepy", model, *plan, "--idle-ttl", "1s")
    rows: list[dict[str, float]] = []
    for _ in range(rounds):
        until("sleepy parked", lambda: model_state(url, "sleepy") == "parked", every_s=0.3)
        sent = datetime.now(UTC)
        ttfb = asyncio.run(first_byte(base, "sleepy"))
        evs = events(url, "control")
        placed = [e for e in evs if e["type"] == "ReplicaPlaced" and e["model"] == "sleepy"][-1]
        healthy = next(e for e in evs if e["type"] == "ReplicaStateChanged" and e["replica_id"] == placed["replica_id"]
                       and e["state"] == "healthy")
        # The router wishes again every tick while the request waits: the first one is the request's.
        wish = next(e for e in events(url, "usage") if e["type"] == "ModelWanted" and e["model"] == "sleepy" and at(e) >= sent)
        rows.append({"request → first byte": ttfb, "  less the engine's start-up": ttfb - startup_s,
                     "request → wish stored": (at(wish) - sent).total_seconds(),
                     "wish → placed": (at(placed) - at(wish)).total_seconds(),
                     "placed → healthy (start-up + check)": (at(healthy) - at(placed)).total_seconds(),
                     "healthy → first byte": ttfb - (at(healthy) - sent).total_seconds()})
    print(f"\nwake: a parked model, one streamed request, {engine} start-up {startup_s * 1e3:.0f} ms; {rounds} rounds")
    for k in rows[0]:
        v = [r[k] for r in rows]
        print(f"  {k:<34} median {statistics.median(v) * 1e3:7.0f} ms   (min {min(v) * 1e3:.0f}, max {max(v) * 1e3:.0f})")


async def load(base: str, model: str, clients: int, stop: asyncio.Event, counts: dict[str, int]) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def client() -> None:
            while not stop.is_set():
                async with s.post(base + "/v1/chat/completions", json=body) as r:
                    await r.read()
                    counts[str(r.status)] = counts.get(str(r.status), 0) + 1

        await asyncio.gather(*(client() for _ in range(clients)))


def scale(url: str, base: str) -> None:
    plan = ("--from-plan", "--precision", "bf16", "--tp", "1", "--context", "8192")
    cli(url, "ctl", "model", "deploy", "busy", MODEL, *plan, "--min-replicas", "1", "--max-replicas", "16",
        "--target-in-flight", "4")
    until("busy serving", lambda: model_state(url, "busy") == "serving")
    counts: dict[str, int] = {}

    async def drive() -> tuple[float, float, float, int]:
        stop = asyncio.Event()
        task = asyncio.create_task(load(base, "busy", 64, stop, counts))
        t0 = time.monotonic()

        def healthy_count() -> int:
            rows = json.loads(cli(url, "ctl", "model", "list", "--json"))
            return next(r["healthy"] for r in rows if r["name"] == "busy")

        placed_at = healthy_at = 0.0
        while time.monotonic() - t0 < 120:
            await asyncio.sleep(0.25)
            evs = await asyncio.to_thread(events, url, "control")
            n_placed = len([e for e in evs if e["type"] == "ReplicaPlaced" and e["model"] == "busy"])
            if n_placed >= 16 and not placed_at:
                placed_at = time.monotonic() - t0
            if placed_at and await asyncio.to_thread(healthy_count) >= 16:
                healthy_at = time.monotonic() - t0
                break
        before = len([e for e in await asyncio.to_thread(events, url, "control") if e["type"] == "ModelAutoscaled"])
        await asyncio.sleep(60 * TICK_S)  # 60 ticks under the same load
        changes = len([e for e in await asyncio.to_thread(events, url, "control") if e["type"] == "ModelAutoscaled"]) - before
        stop.set()
        await task
        t1 = time.monotonic()
        while time.monotonic() - t1 < 120:
            await asyncio.sleep(0.25)
            scaled = [e for e in await asyncio.to_thread(events, url, "control") if e["type"] == "ModelAutoscaled"]
            if scaled and scaled[-1]["replicas"] == 1:
                return placed_at, healthy_at, time.monotonic() - t1, changes
        raise SystemExit("never scaled back down")

    placed_s, healthy_s, down_s, changes = asyncio.run(drive())
    scaled = [e for e in events(url, "control") if e["type"] == "ModelAutoscaled"]
    print(f"\nscale: 64 clients back to back, target 4 in flight per replica, 1..16 replicas, router tick {TICK_S:g} s")
    print(f"  16 replicas placed after            {placed_s / TICK_S:5.1f} ticks ({placed_s:.1f} s)")
    print(f"  16 replicas healthy after           {healthy_s / TICK_S:5.1f} ticks ({healthy_s:.1f} s; 15 fake engines starting on 2 cores)")
    print(f"  count changes in the next 60 ticks  {changes}")
    print(f"  back to 1 after the load stopped    {down_s / TICK_S:5.1f} ticks ({down_s:.1f} s; the down window is 30 maps)")
    print(f"  decisions: {[(e['replicas'], e['reason']) for e in scaled]}")
    print(f"  replies: {counts}")


ROOT = Path(__file__).resolve().parent.parent
SLEEPY_ARGS = ("-c", "2048", "-np", "1", "-ngl", "999", "-t", "1")  # what the agent starts it with


def engine_alone(binary: str, gguf: Path, rounds: int) -> float:
    """Median seconds from spawning llama-server to its first answered one-token completion."""

    async def once() -> float:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(binary, "-m", str(gguf), *SLEEPY_ARGS, "--host", "127.0.0.1",
                                                    "--port", str(port), stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.DEVNULL)
        try:
            async with aiohttp.ClientSession() as s:
                while True:
                    try:
                        async with s.post(base + "/v1/completions", json={"prompt": "ping", "max_tokens": 1}) as r:
                            if r.status == 200:
                                return time.monotonic() - t0
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.005)
        finally:
            proc.terminate()
            await proc.wait()

    return statistics.median(asyncio.run(once()) for _ in range(rounds))


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def router_overhead(url: str, base: str, model_dir: Path, n: int = 40) -> None:
    """The same non-streamed request straight to llama-server and through the router, alternating."""
    cli(url, "ctl", "model", "deploy", "steady", str(model_dir), "--from-plan", "--precision", "q8_0",
        "--context", "2048")
    until("steady serving", lambda: model_state(url, "steady") == "serving")
    endpoint = next(e["endpoint"] for e in reversed(events(url, "control"))
                    if e["type"] == "ReplicaStateChanged" and e["model"] == "steady" and e["state"] == "healthy")
    prompt = "the quick brown fox jumps over the lazy dog " * 8

    async def drive() -> tuple[list[float], list[float]]:
        direct: list[float] = []
        routed: list[float] = []
        async with aiohttp.ClientSession() as s:
            for i in range(2 * n + 2):
                target, times = (endpoint, direct) if i % 2 == 0 else (base, routed)
                body = {"model": "steady", "prompt": prompt, "max_tokens": 8, "cache_prompt": False}
                t0 = time.monotonic()
                async with s.post(target + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                if i >= 2:  # the first pair warms both paths
                    times.append(time.monotonic() - t0)
        return direct, routed

    direct, routed = asyncio.run(drive())
    d, r = statistics.median(direct), statistics.median(routed)
    print(f"\nrouter overhead: {n} completions each (77-token prompt, 8 tokens), straight to llama-server and "
          "through the router, alternating")
    print(f"  direct  median {d * 1e3:7.1f} ms")
    print(f"  router  median {r * 1e3:7.1f} ms   (+{(r - d) * 1e3:.1f} ms, x{r / d:.2f})")


def real(args: argparse.Namespace, tmp: Path) -> None:
    built = subprocess.run(["bash", str(ROOT / "scripts" / "llama-server.sh")], capture_output=True, text=True,
                           check=True)
    binary = built.stdout.strip().splitlines()[-1]
    model_dir = tmp / "tiny"
    subprocess.run([LLMGW, "demo-model", str(model_dir), "--layers", "4", "--embd", "256"], check=True,
                   stdout=subprocess.DEVNULL)
    gguf = next(model_dir.glob("*.gguf"))
    alone = engine_alone(binary, gguf, args.rounds)
    up = subprocess.Popen([LLMGW, "up", "--data-dir", str(tmp / "data"), "--port", "0", "--router-listen", "127.0.0.1:0",
                           "--router-tick", f"{TICK_S:g}", "--simulate", str(ROOT / "examples" / "cpu.toml"),
                           "--engines", "real", "--engine-cmd", f"llama.cpp={binary} -t 1", "--heartbeat-s", "1",
                           "--dashboard-listen", "off", "--insecure"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        url, base = _urls(up)
        until("the simulated node", lambda: json.loads(cli(url, "ctl", "status", "--replay", "--json"))["nodes"] == 1)
        wake(url, base, args.rounds, alone, model=str(model_dir),
             plan=("--from-plan", "--precision", "q8_0", "--context", "2048"), engine="llama-server (measured alone)")
        router_overhead(url, base, model_dir)
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(30)


def _urls(up: subprocess.Popen[str]) -> tuple[str, str]:
    """The NATS URL and the router's base URL, from the lines ``up`` prints."""
    assert up.stdout is not None
    match = re.match(r"nats: (\S+)", up.stdout.readline())
    assert match
    for line in up.stdout:
        if m := re.match(r"router: (\S+)/v1", line):
            return match.group(1), m.group(1)
    raise SystemExit("up exited before it printed the router's URL")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--startup-s", type=float, default=2.0)
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument("--engine", choices=["fake", "real"], default="fake")
    args = ap.parse_args()
    if args.engine == "real":
        real(args, Path(tempfile.mkdtemp(prefix="llmgw-bench-demand-")))
        return
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-demand-"))
    (tmp / "fleet.toml").write_text(FLEET)
    up = subprocess.Popen([LLMGW, "up", "--data-dir", str(tmp / "data"), "--port", "0", "--router-listen", "127.0.0.1:0",
                           "--router-tick", f"{TICK_S:g}", "--no-example", "--insecure"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    agent = None
    try:
        url, base = _urls(up)
        agent = subprocess.Popen([LLMGW, "agent", "--simulate", str(tmp / "fleet.toml"), "--heartbeat-s", "1",
                                  "--engine-startup-s", f"{args.startup_s:g}",
                                  "--engine-cmd", f"fake={LLMGW} fake-engine --latency-ms 200", "--nats-url", url],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        until("the agent's nodes", lambda: json.loads(cli(url, "ctl", "status", "--replay", "--json"))["nodes"] == 2)
        wake(url, base, args.rounds, args.startup_s)
        if not args.skip_scale:
            scale(url, base)
    finally:
        for p in (agent, up):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(30)


if __name__ == "__main__":
    main()
