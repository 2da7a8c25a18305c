"""The demand loop on real processes: how long a parked model takes to answer, and how load scales it.

    python benchmarks/demand.py [--rounds 5] [--startup-s 2] [--skip-scale]
    python benchmarks/demand.py --engine real [--rounds 5]
    python benchmarks/demand.py --engine vllm --rounds 3 [--alternations 5]

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

``--engine vllm``: vLLM's CPU build (scripts/vllm.sh) on ``llmgw demo-model --format hf`` under
``up --simulate examples/cpu-vllm.toml --engines real`` (one small simulated card; the agent gives
vLLM a CPU engine's arguments, ``engine_argv(cpu=True)``). Once the node has reported its vLLM
version, the plan's first vLLM candidate (``ctl model plan --json``, context 1024) gives the spec,
and vLLM is started alone ``--rounds`` times with exactly the argv the agent builds from it
(spawn → /health and a one-token completion answered, polled every 20 ms; the agent's own vLLM is
then checked to have run with the same argv, but the port). The wake is split further by a probe
beside it: when the agent's vLLM process is there and when it first answers that same check, so
that "less this very start's own" takes away the start-up of the start being measured (a vLLM start
here varies by seconds from one to the next; the alone median cannot resolve half a second). The
router's overhead is vLLM's own load generator, ``vllm bench serve --backend openai`` (random 64
tokens in, 16 out with --ignore-eos, 64 prompts, concurrency 8, a seed per pair), at the engine and
at the router in turn, ``--alternations`` pairs after a warm-up pair: medians, per-pair ratios, and
the CPU seconds the router and vLLM's processes spent in each invocation.

One vLLM at a time: before each start it waits (bounded) until no other vLLM runs here, and a
start, wake or pair during which another one ran (a colleague's test) is left out and run again.
Everything it starts is ended by process group; every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from control_loop import (  # the same CLI and event helpers, side by side in benchmarks/
    at,
    cli,
    events,
)

from llmgw import messages as m
from llmgw.engine.argv import engine_argv, parse_engine_cmds

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


async def first_byte(base: str, model: str, within_s: float = 180) -> float:
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        async with s.post(base + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=within_s)) as r:
            assert r.status == 200, await r.text()
            await r.content.readany()
            ttfb = time.monotonic() - t0
            await r.read()
    return ttfb


def wake(url: str, base: str, rounds: int, startup_s: float, model: str = MODEL,
         plan: tuple[str, ...] = ("--from-plan", "--precision", "bf16", "--tp", "1", "--context", "8192"),
         engine: str = "fake engine", within_s: float = 120, before: Any = None, deployed: Any = None,
         watch: Any = None, probe: Any = None) -> None:
    """``before()`` runs before every engine start (the deploy's, each wake's), ``deployed()`` once after the
    deploy; a round run inside ``watch()`` that ``disturbed`` it is left out and run again (at most ``rounds``
    more); ``probe()`` (an ``EngineProbe``) splits the engine's start from the agent's part of it."""
    if before:
        before()
    cli(url, "ctl", "model", "deploy", "sleepy", model, *plan, "--idle-ttl", "1s")
    if deployed:
        deployed()
    rows: list[dict[str, float]] = []
    for i in range(2 * rounds if watch else rounds):
        if len(rows) == rounds:
            break
        until("sleepy parked", lambda: model_state(url, "sleepy") == "parked", within_s=within_s, every_s=0.3)
        if before:
            before()
        sent = datetime.now(UTC)
        with watch() if watch else contextlib.nullcontext() as others, \
                probe() if probe else contextlib.nullcontext() as seen:
            ttfb = asyncio.run(first_byte(base, "sleepy", within_s))
        if others is not None and disturbed(f"wake {i + 1} ({ttfb:.2f} s)", others):
            continue
        evs = events(url, "control")
        placed = [e for e in evs if e["type"] == "ReplicaPlaced" and e["model"] == "sleepy"][-1]
        mine = [e for e in evs if e["type"] == "ReplicaStateChanged" and e["replica_id"] == placed["replica_id"]]
        starting = next(e for e in mine if e["state"] == "starting")
        healthy = next(e for e in mine if e["state"] == "healthy")
        # The router wishes again every tick while the request waits: the first one is the request's.
        wish = next(e for e in events(url, "usage") if e["type"] == "ModelWanted" and e["model"] == "sleepy" and at(e) >= sent)
        split: dict[str, float] = {}
        own: dict[str, float] = {}
        if seen is not None:
            if seen.spawned is None or seen.ready is None:
                raise SystemExit(f"the probe saw no vLLM start or answer (spawned {seen.spawned}, ready {seen.ready})")
            own = {"  less this very start's own (probe)": ttfb - (seen.ready - seen.spawned).total_seconds()}
            split = {"    starting → its process is there": (seen.spawned - at(starting)).total_seconds(),
                     "    its process → it answers (20 ms polls)": (seen.ready - seen.spawned).total_seconds(),
                     "    it answers → healthy reported": (at(healthy) - seen.ready).total_seconds()}
        rows.append({"request → first byte": ttfb, "  less the engine's start-up": ttfb - startup_s, **own,
                     "request → wish stored": (at(wish) - sent).total_seconds(),
                     "wish → placed": (at(placed) - at(wish)).total_seconds(),
                     "placed → healthy (start-up + check)": (at(healthy) - at(placed)).total_seconds(),
                     "  placed → agent starts it": (at(starting) - at(placed)).total_seconds(),
                     "  starting → healthy": (at(healthy) - at(starting)).total_seconds(),
                     "    less the engine's start-up": (at(healthy) - at(starting)).total_seconds() - startup_s,
                     **split,
                     "healthy → first byte": ttfb - (at(healthy) - sent).total_seconds()})
    if len(rows) < rounds:
        raise SystemExit(f"only {len(rows)} wakes ran alone")
    print(f"\nwake: a parked model, one streamed request, {engine} start-up {startup_s * 1e3:.0f} ms; {rounds} rounds")
    for k in rows[0]:
        v = [r[k] for r in rows]
        each = ", ".join(f"{x * 1e3:.0f}" for x in v)
        print(f"  {k:<42} median {statistics.median(v) * 1e3:7.0f} ms   (min {min(v) * 1e3:.0f}, max {max(v) * 1e3:.0f}; "
              f"each: {each})")


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
    keyed = {"Authorization": f"Bearer {engine_key(endpoint)}"}  # straight to the engine: its own key

    async def drive() -> tuple[list[float], list[float]]:
        direct: list[float] = []
        routed: list[float] = []
        async with aiohttp.ClientSession() as s:
            for i in range(2 * n + 2):
                target, times = (endpoint, direct) if i % 2 == 0 else (base, routed)
                body = {"model": "steady", "prompt": prompt, "max_tokens": 8, "cache_prompt": False}
                t0 = time.monotonic()
                async with s.post(target + "/v1/completions", json=body, headers=keyed if target == endpoint else {}) as r:
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


VLLM_CONTEXT = 1024
VLLM_START_S = 900  # one vLLM start on a loaded two-core box (20–50 s when quiet), with room
OTHERS_WAIT_S = 1800  # a colleague's end-to-end test starts vLLM three times


def vllm_processes(mine: str = "", tests: bool = True) -> dict[int, str]:
    """Every run of vLLM's program on this machine (argv ``…/vllm serve``, ``…/vllm --version``; not a command
    line that merely names it, like ``up --engine-cmd "vllm=… serve"``), vLLM's own engine processes
    (``VLLM::…``) and (``tests``) a vLLM end-to-end test; with ``mine``, only the ``vllm serve`` leaders whose
    command line names it."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0")
        except OSError:
            continue
        serve = any(Path(a).name == "vllm" and b == "serve" for a, b in zip(argv, argv[1:], strict=False))
        # Any run of the program (``vllm --version`` imports all of vLLM too: seconds of both cores).
        program = any(Path(a).name == "vllm" for a in argv[:2])
        if mine:
            if serve and mine in argv:
                found[int(entry.name)] = shlex.join(argv)
        elif program or argv[0].startswith("VLLM::") or (tests and any("test_e2e_vllm" in a for a in argv)):
            found[int(entry.name)] = shlex.join(argv)[:160]
    return found


def alone(within_s: float = OTHERS_WAIT_S) -> None:
    """Until no other vLLM runs here: one vLLM at a time on this box (bounded)."""
    t0, said = time.monotonic(), False
    while others := vllm_processes():
        if time.monotonic() - t0 > within_s:
            raise SystemExit(f"another vLLM still runs after {within_s:g}s: {others}")
        if not said:
            print(f"  (waiting for other vLLM processes to end: {others})", flush=True)
            said = True
        time.sleep(2)
    if said:
        print(f"  (waited {time.monotonic() - t0:.0f} s for them)", flush=True)


class Others:
    """Whether another vLLM ran beside ours while a measurement ran (a colleague's test may start one at any
    time, though none ran when ours started): sampled every second in a thread. Ours are the process groups
    of the ``vllm serve`` leaders that name ``mine`` (the model directory), and ``also``."""

    def __init__(self, mine: str, also: tuple[int, ...] = ()) -> None:
        self.mine, self.also = mine, (*also, os.getpgid(0))  # and this one's: its own vllm bench serve
        self.seen: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _groups(self, pids: Any) -> set[int]:
        out = set(self.also)
        for pid in pids:
            with contextlib.suppress(OSError):
                out.add(os.getpgid(pid))
        return out

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            ours = self._groups(vllm_processes(self.mine))
            for pid, argv in vllm_processes(tests=False).items():
                with contextlib.suppress(OSError):
                    if os.getpgid(pid) not in ours:
                        self.seen[pid] = argv

    def __enter__(self) -> Others:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def disturbed(what: str, others: Others) -> bool:
    if others.seen:
        print(f"  {what}: another vLLM ran beside it ({others.seen}); left out, measured again", flush=True)
    return bool(others.seen)


class EngineProbe:
    """In a thread, beside a wake: when the agent's vLLM for ``name`` is first there (its process), and when it
    first answers the agent's own check (/health, then a one-token completion), polled every 20 ms as vLLM was
    alone. What is left of "starting → healthy" is the agent's: its spawn, its poll's spacing, its readings."""

    def __init__(self, mine: str, name: str) -> None:
        self.mine, self.name = mine, name
        self.spawned: datetime | None = None
        self.ready: datetime | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _port(self) -> int | None:
        for argv in vllm_processes(self.mine).values():
            args = shlex.split(argv)
            if args[args.index("--served-model-name") + 1] == self.name:
                return int(args[args.index("--port") + 1])
        return None

    def _answers(self, base: str) -> bool:
        try:
            with urllib.request.urlopen(base + "/health", timeout=10) as r:
                if r.status != 200:
                    return False
            body = json.dumps({"model": self.name, "prompt": "ping", "max_tokens": 1}).encode()
            ask = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(ask, timeout=10) as r:
                return bool(r.status == 200)
        except (OSError, http.client.HTTPException):
            return False

    def _run(self) -> None:
        port = None
        while not self._stop.is_set():
            if port is None and (port := self._port()) is not None:
                self.spawned = datetime.now(UTC)
            if port is not None and self._answers(f"http://127.0.0.1:{port}"):
                self.ready = datetime.now(UTC)
                return
            self._stop.wait(0.02)

    def __enter__(self) -> EngineProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)


def load_average(when: str) -> None:
    print(f"  (load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} {when})", flush=True)


def group_alive(pgid: int) -> bool:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def end_group(pgid: int, proc: subprocess.Popen[Any] | None = None) -> None:
    """SIGTERM the group, SIGKILL what is left after 30 s, and wait (bounded) until none of it is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (proc.poll() is None if proc else group_alive(pgid)):
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    if proc:
        proc.wait(10)
    until(f"process group {pgid} gone", lambda: not group_alive(pgid), within_s=30, every_s=0.2)


async def answered(base: str, name: str, proc: subprocess.Popen[bytes], t0: float) -> float | None:
    """Seconds from t0 until the engine answers the agent's own check: /health, then a one-token completion;
    None if it exited first."""
    body = {"model": name, "prompt": "ping", "max_tokens": 1}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        while time.monotonic() - t0 < VLLM_START_S:
            if proc.poll() is not None:
                return None
            try:
                async with s.get(base + "/health") as r:
                    ok = r.status == 200
                if ok:
                    async with s.post(base + "/v1/completions", json=body) as r:
                        if r.status == 200:
                            return time.monotonic() - t0
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.02)
    raise SystemExit(f"vLLM did not answer within {VLLM_START_S}s")


def vllm_alone(argv_at: Any, name: str, rounds: int, logs: Path, mine: str) -> list[float]:
    """Spawn → first answered one-token completion of vLLM started alone with ``argv_at(port)``, each round;
    a round another vLLM ran beside is measured again (at most ``rounds`` times more)."""
    times: list[float] = []
    for i in range(2 * rounds):
        if len(times) == rounds:
            break
        alone()
        port = free_port()
        log = logs / f"vllm-alone-{i + 1}.log"
        with log.open("wb") as out:
            t0 = time.monotonic()
            # What the agent gives it: its own environment, the placed card's index, its own session.
            proc = subprocess.Popen(argv_at(port), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=dict(os.environ, CUDA_VISIBLE_DEVICES="0"), start_new_session=True)
            try:
                with Others(mine, also=(proc.pid,)) as others:
                    took = asyncio.run(answered(f"http://127.0.0.1:{port}", name, proc, t0))
            finally:
                end_group(proc.pid, proc)
        if took is None:
            raise SystemExit(f"vLLM exited {proc.returncode} before it answered; {log}:\n"
                             + "\n".join(log.read_text(errors="replace").splitlines()[-20:]))
        if disturbed(f"vLLM alone, start {i + 1} ({took:.2f} s)", others):
            continue
        times.append(took)
        print(f"  vLLM alone, start {i + 1}: {times[-1]:.2f} s", flush=True)
    if len(times) < rounds:
        raise SystemExit(f"only {len(times)} of {2 * rounds} vLLM starts ran alone")
    return times


def agent_argv(model_dir: Path, name: str, within_s: float = VLLM_START_S) -> list[str]:
    """The command line the agent started vLLM with for ``name``, read from the running process."""
    def found() -> list[str] | None:
        for argv in vllm_processes(str(model_dir)).values():
            args = shlex.split(argv)
            if args[args.index("--served-model-name") + 1] == name:
                # /proc shows the interpreter the script's #! line names before it: from the script on.
                return args[next(i for i, a in enumerate(args) if Path(a).name == "vllm"):]
        return None

    return until(f"the agent's vLLM for {name}", found, within_s=within_s, every_s=0.2)


def without_port(argv: list[str]) -> list[str]:
    return [a if prev != "--port" else "PORT" for prev, a in zip(["", *argv], argv, strict=False)]


TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pgid: int = 0, pid: int = 0) -> float:
    """CPU seconds (user + system) of the live processes of group ``pgid``, or of process ``pid``."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or (pid and int(entry.name) != pid):
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if pid or int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / TICKS


def child(parent: int, word: bytes) -> int:
    """The child of ``parent`` whose command line has ``word`` (``up``'s router)."""
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent \
                    and word in (entry / "cmdline").read_bytes().split(b"\0"):
                return int(entry.name)
    raise SystemExit(f"no {word.decode()} under process {parent}")


def engine_key(endpoint: str) -> str:
    """The API key of the engine listening at ``endpoint``, read from its environment as the node's own user
    may (only routers learn it on the bus): what a direct run sends."""
    from llmgw.agent.simnvml import engine_key as key_of

    port = endpoint.rsplit(":", 1)[1].encode()
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            argv = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
            if b"--port" in argv and argv[argv.index(b"--port") + 1] == port and (key := key_of(int(entry.name))):
                return key
    raise SystemExit(f"no engine with a key listens at {endpoint}")


def vllm_bench(binary: str, target: str, model_dir: Path, out: Path, label: str, seed: int,
               key: str = "") -> dict[str, Any]:
    """One ``vllm bench serve`` run against ``target`` (with the engine's API key, straight to it); its JSON result."""
    cmd = [binary, "bench", "serve", "--backend", "openai", "--base-url", target, "--model", "steady",
           "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", "64",
           "--random-output-len", "16", "--ignore-eos", "--num-prompts", "64", "--max-concurrency", "8",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--seed", str(seed), "--disable-tqdm", "--save-result",
           "--result-dir", str(out),
           "--result-filename", f"{label}.json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False,
                       env={**os.environ, "OPENAI_API_KEY": key} if key else None)
    (out / f"{label}.log").write_text(r.stdout + r.stderr)
    if r.returncode:
        raise SystemExit(f"vllm bench serve exited {r.returncode} ({out / label}.log):\n{(r.stdout + r.stderr)[-3000:]}")
    result: dict[str, Any] = json.loads((out / f"{label}.json").read_text())
    if result.get("failed") or result["completed"] != 64:
        raise SystemExit(f"vllm bench serve: {result['completed']} completed, {result.get('failed')} failed ({label})")
    return result


def vllm_router_overhead(url: str, base: str, model_dir: Path, binary: str, out: Path, alternations: int,
                         up: int) -> None:
    """vLLM's own load generator straight at the engine and at the router, alternating, one pair at a time;
    with the CPU seconds the router and the engine's processes spent in each run."""
    until("sleepy parked", lambda: model_state(url, "sleepy") == "parked", within_s=VLLM_START_S)
    cli(url, "ctl", "model", "remove", "sleepy")
    alone()
    cli(url, "ctl", "model", "deploy", "steady", str(model_dir), "--from-plan", "--engine", "vllm", "--context",
        str(VLLM_CONTEXT))
    until("steady serving", lambda: model_state(url, "steady") == "serving", within_s=VLLM_START_S, every_s=1)
    endpoint = next(e["endpoint"] for e in reversed(events(url, "control"))
                    if e["type"] == "ReplicaStateChanged" and e["model"] == "steady" and e["state"] == "healthy")
    key = engine_key(endpoint)
    out.mkdir(parents=True, exist_ok=True)
    router = child(up, b"router")
    engine = os.getpgid(next(iter(vllm_processes(str(model_dir)))))

    def bench(target: str, label: str, seed: int) -> dict[str, Any]:
        """One run, with the CPU seconds the router and vLLM spent over the whole invocation (its ~20 s of
        start-up too, while both sit idle: the router's idle share is what it spends beside a direct run)."""
        r0, e0, t0 = cpu_s(pid=router), cpu_s(pgid=engine), time.monotonic()
        result = vllm_bench(binary, target, model_dir, out, label, seed, key if target == endpoint else "")
        return {**result, "router_cpu_s": cpu_s(pid=router) - r0, "engine_cpu_s": cpu_s(pgid=engine) - e0,
                "wall_s": time.monotonic() - t0}

    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    # Pair 0 warms both paths and is left out. Each run has its own seed (its own random prompts), so none is
    # answered from the prefix cache another run filled; the two runs of a pair share one.
    for i in range(2 * alternations + 1):
        if len(pairs) == alternations:
            break
        with Others(str(model_dir)) as others:
            d = bench(endpoint, f"direct-{i}", seed=1000 + i)
            r = bench(base, f"router-{i}", seed=1000 + i)
        if i and disturbed(f"pair {i}", others):
            continue
        if i:
            pairs.append((d, r))
            print(f"  pair {i}: direct {d['request_throughput']:.2f} req/s, TTFT {d['median_ttft_ms']:.1f} ms (run "
                  f"{d['duration']:.2f} s; over the {d['wall_s']:.0f} s invocation vLLM CPU {d['engine_cpu_s']:.2f} s, "
                  f"router {d['router_cpu_s']:.2f} s); router {r['request_throughput']:.2f} req/s, TTFT "
                  f"{r['median_ttft_ms']:.1f} ms (run {r['duration']:.2f} s; over {r['wall_s']:.0f} s vLLM CPU "
                  f"{r['engine_cpu_s']:.2f} s, router {r['router_cpu_s']:.2f} s)", flush=True)
        else:
            (out / f"direct-{i}.json").rename(out / "warm-up-direct.json")
            (out / f"router-{i}.json").rename(out / "warm-up-router.json")

    if len(pairs) < alternations:
        raise SystemExit(f"only {len(pairs)} pairs ran alone")

    def med(which: int, key: str) -> float:
        return statistics.median(p[which][key] for p in pairs)

    ratios = [p[1]["request_throughput"] / p[0]["request_throughput"] for p in pairs]
    ttft = [p[1]["median_ttft_ms"] - p[0]["median_ttft_ms"] for p in pairs]
    tpot = [p[1]["median_tpot_ms"] - p[0]["median_tpot_ms"] for p in pairs]
    e2el = [p[1]["median_e2el_ms"] - p[0]["median_e2el_ms"] for p in pairs]
    print(f"\nrouter overhead: vllm bench serve --backend openai, random 64 in / 16 out (--ignore-eos), 64 prompts, "
          f"concurrency 8; direct at {endpoint} and router at {base}, alternating, {alternations} pairs (+1 warm-up)")
    for label, which in (("direct", 0), ("router", 1)):
        print(f"  {label}  median {med(which, 'request_throughput'):6.2f} req/s  {med(which, 'output_throughput'):7.1f} "
              f"output tok/s  median TTFT {med(which, 'median_ttft_ms'):7.1f} ms  TPOT {med(which, 'median_tpot_ms'):6.1f} ms"
              f"  E2E {med(which, 'median_e2el_ms'):7.1f} ms")
    print(f"  router / direct throughput, per pair: {', '.join(f'{x:.3f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.3f} (goal ≥ 0.97)")
    print(f"  router − direct median TTFT, per pair: {', '.join(f'{x:+.1f}' for x in ttft)} ms; "
          f"median {statistics.median(ttft):+.1f} ms (goal ≤ +2 ms)")
    print(f"  router − direct median TPOT, per pair: {', '.join(f'{x:+.2f}' for x in tpot)} ms; "
          f"median {statistics.median(tpot):+.2f} ms")
    print(f"  router − direct median E2E latency, per pair: {', '.join(f'{x:+.1f}' for x in e2el)} ms; "
          f"median {statistics.median(e2el):+.1f} ms")
    busy = [p[1]["router_cpu_s"] - p[0]["router_cpu_s"] for p in pairs]
    print(f"  CPU over each invocation (median): vLLM's processes {med(0, 'engine_cpu_s'):.2f} s direct, "
          f"{med(1, 'engine_cpu_s'):.2f} s routed; the router {med(1, 'router_cpu_s'):.2f} s routed, "
          f"{med(0, 'router_cpu_s'):.2f} s idle beside a direct run: {statistics.median(busy) / 64 * 1e3:.1f} ms of "
          f"router CPU a streamed request; runs of {med(0, 'duration'):.2f} s direct, {med(1, 'duration'):.2f} s "
          f"routed, on {os.cpu_count()} cores")


def vllm(args: argparse.Namespace, tmp: Path) -> None:
    """``--engine vllm``: the vLLM CPU build (scripts/vllm.sh) on ``demo-model --format hf`` under examples/cpu-vllm.toml."""
    built = subprocess.run(["bash", str(ROOT / "scripts" / "vllm.sh")], capture_output=True, text=True, check=True,
                           timeout=1800)
    binary = built.stdout.strip().splitlines()[-1]
    model_dir = tmp / "tiny-hf"
    subprocess.run([LLMGW, "demo-model", str(model_dir), "--format", "hf"], check=True, stdout=subprocess.DEVNULL,
                   timeout=300)
    logs = tmp / "logs"
    logs.mkdir()
    engine_cmd = f"vllm={binary} serve"
    with (logs / "up.stderr").open("w") as err:
        up = subprocess.Popen([LLMGW, "up", "--data-dir", str(tmp / "data"), "--port", "0", "--router-listen",
                               "127.0.0.1:0", "--router-tick", f"{TICK_S:g}", "--simulate",
                               str(ROOT / "examples" / "cpu-vllm.toml"), "--engines", "real", "--engine-cmd", engine_cmd,
                               "--heartbeat-s", "1", "--dashboard-listen", "off", "--insecure"],
                              stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    try:
        url, base = _urls(up)
        drain = threading.Thread(target=lambda: (logs / "up.stdout").write_text("".join(up.stdout or ())), daemon=True)
        drain.start()
        until("the simulated node", lambda: json.loads(cli(url, "ctl", "status", "--replay", "--json"))["nodes"] == 1)
        # The agent asks vLLM its version beside the heartbeats (an import of all of vLLM): the plan is made for it.
        until("the node's vLLM version", lambda: re.search(r'"vllm_version":\s*"[^"]+"',
                                                            cli(url, "replay", "--stream", "fleet", "--json")),
              within_s=600, every_s=1)
        plan = m.PLAN_REPLY_DECODER.decode(cli(url, "ctl", "model", "plan", str(model_dir), "--context",
                                               str(VLLM_CONTEXT), "--json"))
        spec = next(c for c in plan.candidates if c.engine == "vllm" and c.fits).spec("sleepy")
        cmds = parse_engine_cmds((engine_cmd,))

        def argv_at(port: int) -> list[str]:
            return engine_argv(spec, port, "127.0.0.1", cmds, simulate=False, cpu=True)

        print(f"vLLM {plan.engine_version}, as the agent starts it: {shlex.join(without_port(argv_at(0)))}", flush=True)
        load_average("before vLLM alone")
        times = vllm_alone(argv_at, spec.name, args.rounds, logs, str(model_dir))
        startup = statistics.median(times)
        print(f"\nvLLM alone: spawn → first answered one-token completion (polled every 20 ms), median "
              f"{startup:.2f} s (each: {', '.join(f'{t:.2f}' for t in times)})", flush=True)

        def same_argv() -> None:
            ran = agent_argv(model_dir, "sleepy")
            same = without_port(ran) == without_port(argv_at(0))
            print(f"  the agent's vLLM: {'the same argv as alone (but the port)' if same else shlex.join(ran)}", flush=True)
            if not same:
                raise SystemExit("the agent ran vLLM otherwise than it was measured alone")

        load_average("before the wakes")
        wake(url, base, args.rounds, startup, model=str(model_dir),
             plan=("--from-plan", "--engine", "vllm", "--context", str(VLLM_CONTEXT)), engine="vLLM (measured alone)",
             within_s=VLLM_START_S, before=alone, deployed=same_argv, watch=lambda: Others(str(model_dir)),
             probe=lambda: EngineProbe(str(model_dir), "sleepy"))
        load_average("before the router overhead")
        vllm_router_overhead(url, base, model_dir, binary, tmp / "bench", args.alternations, up.pid)
        load_average("at the end")
    finally:
        end_group(up.pid, up)
        for pid in vllm_processes(str(model_dir)):  # a vLLM of ours the agent left behind
            print(f"  left behind: {pid}; ending its group")
            with contextlib.suppress(ProcessLookupError):
                end_group(os.getpgid(pid))
        print(f"\nlogs: {logs} (vLLM alone, up), {tmp / 'data' / 'logs'} (the agent's engines), {tmp / 'bench'}")


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
    ap.add_argument("--engine", choices=["fake", "real", "vllm"], default="fake")
    ap.add_argument("--alternations", type=int, default=5, help="--engine vllm: router/direct pairs of vllm bench serve")
    args = ap.parse_args()
    if args.engine == "vllm":
        vllm(args, Path(tempfile.mkdtemp(prefix="llmgw-bench-demand-")))
        return
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
