"""Replicas that share a GPU, as the agent runs them: started one at a time, vLLM sized to its share,
and what each engine holds checked against what it booked (issue 40).

Against a real nats-server, with fake engines on a simulated node, a small stand-in engine whose
memory the test moves, and one real llama-server on a simulated card.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import msgspec
import pytest
from running import running, until
from streams import stored

from llmgw import messages as m
from llmgw import subjects
from llmgw.agent.node import Agent
from llmgw.agent.runs import EngineConfig
from llmgw.agent.simnvml import SimNvml
from llmgw.agent.supervisor import EngineSupervisor
from llmgw.bus import Bus, Outbox
from llmgw.engine.argv import default_commands, engine_argv
from llmgw.fleet.fold import decode_state, encode_state
from llmgw.fleet.state import Cursor, booking_mib, fold
from llmgw.fleetfile import inventory, load, parse

NODE = "n1"
CPU_FLEET = Path(__file__).resolve().parents[1] / "examples" / "cpu.toml"  # one simulated 16 GiB card
CARD_MIB = 16384
FLEET = f"""
[[nodes]]
name = "{NODE}"
fabric = "local"
gpu_class = "CPU-16GB"
gpu_count = 2
gpu_memory_mib = {CARD_MIB}
"""


def spec(name: str, **kw: object) -> m.ModelSpec:
    base: dict[str, object] = dict(name=name, source="/models/x.gguf", precision="q8_0", engine="llama.cpp",
                                   gpu_class="CPU-16GB", context=512, tp=1, gib_per_gpu=1.0)
    base.update(kw)
    return m.ModelSpec(**base)  # type: ignore[arg-type]


def placed(rid: str, s: m.ModelSpec, gpu: int = 0, mib: int = 1024) -> m.ReplicaPlaced:
    ref = m.GpuRef(node=NODE, index=gpu, uuid=f"GPU-{gpu}", mib=mib)
    return m.ReplicaPlaced(at=m.utcnow(), replica_id=rid, model=s.name, nodes=(NODE,), gpus=(ref,), spec=s,
                           fabric="local")


async def deploy(bus: Bus, *placements: m.ReplicaPlaced) -> None:
    for p in placements:
        await bus.publish(m.ModelDeclared(at=p.at, spec=p.spec))
        await bus.publish(p)


async def control(bus: Bus) -> list[m.AnyEvent]:
    return await stored(bus, subjects.STREAM_CONTROL)


def reports(events: list[m.AnyEvent], rid: str | None = None) -> list[m.ReplicaStateChanged]:
    return [e for e in events if isinstance(e, m.ReplicaStateChanged) and rid in (None, e.replica_id)]


@pytest.fixture
async def supervise(bus: Bus) -> AsyncIterator[Callable[[EngineConfig], EngineSupervisor]]:
    """Supervisors of node n1 on demand, with an outbox that delivers as the agent's does; all stopped after."""
    outbox: Outbox = bus.outbox()
    tasks = [asyncio.create_task(outbox.run())]

    def start(config: EngineConfig) -> EngineSupervisor:
        sup = EngineSupervisor(NODE, config)
        tasks.append(asyncio.create_task(sup.run(bus, outbox)))
        return sup

    try:
        yield start
    finally:
        for t in reversed(tasks):
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)


# --- one at a time --------------------------------------------------------------------------------


async def test_engines_sharing_a_gpu_start_one_at_a_time_and_others_do_not_wait(
        bus: Bus, supervise: Callable[[EngineConfig], EngineSupervisor]) -> None:
    await deploy(bus, placed("a-r1", spec("a")), placed("b-r1", spec("b")), placed("c-r1", spec("c"), gpu=1))
    sup = supervise(EngineConfig(simulate=True, fake_startup_s=1.0, health_timeout_s=30))

    async def all_healthy() -> bool:
        return {r.replica_id for r in reports(await control(bus)) if r.state == "healthy"} == {"a-r1", "b-r1", "c-r1"}

    # Sampled between the loop's steps: b's engine never runs while a's, on the same GPU, is starting.
    seen_waiting = False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 40
    while not await all_healthy():
        a, b = sup.runs.get("a-r1"), sup.runs.get("b-r1")
        if a is not None and b is not None:
            assert not (b.procs and a.state == "starting"), "b's engine was started while a's was still starting"
            seen_waiting = seen_waiting or (a.state == "starting" and not b.procs)
        assert loop.time() < deadline, [(r.replica_id, r.state, r.detail) for r in reports(await control(bus))]
        await asyncio.sleep(0.02)
    assert seen_waiting

    events = reports(await control(bus))
    b = [(r.state, r.detail) for r in events if r.replica_id == "b-r1"]
    assert b == [("starting", "waiting for a-r1 to finish starting on GPU 0 (engines sharing a card start one at a "
                              "time)"), ("starting", ""), ("healthy", "")]
    # Its start (and so its endpoint) comes only after a's health; c, on the other GPU, never waited.
    order = [(r.replica_id, r.state, bool(r.detail)) for r in events]
    assert order.index(("a-r1", "healthy", False)) < order.index(("b-r1", "starting", False))
    assert [r.state for r in events if r.replica_id == "c-r1"] == ["starting", "healthy"]


async def test_the_wait_ends_when_the_engine_ahead_stops_or_after_its_bound(
        bus: Bus, supervise: Callable[[EngineConfig], EngineSupervisor]) -> None:
    # Engines that take a minute to start: nothing here waits for one to be healthy.
    await deploy(bus, placed("a-r1", spec("a")), placed("b-r1", spec("b")))
    sup = supervise(EngineConfig(simulate=True, fake_startup_s=60, health_timeout_s=120))
    def b_waits() -> bool:
        a, b = sup.runs.get("a-r1"), sup.runs.get("b-r1")
        return a is not None and bool(a.procs) and b is not None and b.state == "starting"

    async def b_started() -> bool:
        return any(r.detail == "" for r in reports(await control(bus), "b-r1"))

    await until(b_waits, "a's engine running and b waiting")
    assert not sup.runs["b-r1"].procs
    await bus.publish(m.ReplicaStopped(at=m.utcnow(), replica_id="a-r1", model="a", reason="requested", code="requested"))
    await until(b_started, "b started once a stopped")

    async def a_states() -> list[str]:
        return [r.state for r in reports(await control(bus), "a-r1")]

    await until(lambda: _count(a_states, 2), "a's stop reported")
    assert await a_states() == ["starting", "stopped"]

    # Bounded: behind an engine that does not finish starting, the next starts beside it after share_wait_s.
    sup.config.share_wait_s = 0.3
    await deploy(bus, placed("c-r1", spec("c")))

    async def c_started() -> list[m.ReplicaStateChanged]:
        return [r for r in reports(await control(bus), "c-r1") if "starting beside it" in r.detail]

    await until(c_started, "c started beside b", limit_s=20)
    (late,) = await c_started()
    assert late.detail == "b-r1 did not finish starting on GPU 0 within 0.3s; starting beside it"
    assert sup.runs["b-r1"].state == "starting"  # still: c did not wait for it to be healthy


# --- sized to its share --------------------------------------------------------------------------


def test_a_shared_vllm_is_given_its_share_of_the_card_as_its_memory_utilization() -> None:
    s = spec("q", engine="vllm", source="Qwen/Qwen2.5-0.5B-Instruct", precision="bf16", gpu_memory_utilization=0.3,
             kv_gib_per_gpu=2.0)
    booked = booking_mib(s, 81920)
    assert booked == 24576  # 0.3 x 80 GiB: what it books is what it is told to take
    argv = engine_argv(s, 8001, "h", default_commands(), simulate=False)
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.3"
    assert float(argv[argv.index("--gpu-memory-utilization") + 1]) * 81920 == pytest.approx(booked, abs=1)
    exclusive = engine_argv(msgspec.structs.replace(s, exclusive=True, gpu_memory_utilization=0.9), 1, "h", default_commands(),
                            simulate=False)
    assert exclusive[exclusive.index("--gpu-memory-utilization") + 1] == "0.9"  # today's behaviour, unchanged
    cpu = engine_argv(s, 1, "h", default_commands(), simulate=False, cpu=True)
    assert "--gpu-memory-utilization" not in cpu  # on a simulated card: the plan's KV bytes instead
    assert cpu[cpu.index("--kv-cache-memory-bytes") + 1] == str(2 << 30)


# --- booked against used ---------------------------------------------------------------------------

# An engine whose resident memory the test moves: llama-server's arguments in, /health and a
# completion answered, POST /grow?mib=N holds N MiB more (touched), POST /shrink lets it all go.
STAND_IN = r'''
import http.server, sys
args = sys.argv[1:]
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
held = []

class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def answer(self, code, body=b"{}"):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.answer(200 if self.path == "/health" else 404)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.startswith("/grow"):
            held.append(bytearray(int(self.path.split("=")[1]) << 20))  # zeroed by the kernel: touched
            for block in held[-1:]:
                block[::4096] = b"\x01" * len(block[::4096])
        elif self.path == "/shrink":
            held.clear()
        self.answer(200, b'{"choices": [{"text": "x"}]}')

http.server.HTTPServer((host, port), H).serve_forever()
'''


async def test_an_engine_over_its_booking_is_reported_once_per_crossing(
        bus: Bus, supervise: Callable[[EngineConfig], EngineSupervisor], tmp_path: Path) -> None:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    cmds = dict(default_commands(), **{"llama.cpp": [sys.executable, str(script)]})
    booked = 160  # MiB: above the stand-in's own ~20, well below it holding 256 more
    await deploy(bus, placed("s-r1", spec("s"), mib=booked))
    supervise(EngineConfig(cmds=cmds, cpu=True, memory_every_s=0.1, health_timeout_s=30))

    async def healthy() -> list[m.ReplicaStateChanged]:
        return [r for r in reports(await control(bus), "s-r1") if r.state == "healthy"]

    async def overbooked() -> list[m.ReplicaOverBooked]:
        return [e for e in await control(bus) if isinstance(e, m.ReplicaOverBooked)]

    async def reported(cond: Callable[[int], bool], what: str, after: int) -> None:
        """Until a healthy report past the first ``after`` holds ``cond``."""
        async def found() -> bool:
            return any(cond(r.observed_memory_mib) for r in (await healthy())[after:])

        await until(found, what)

    await until(healthy, "the stand-in healthy")
    first = (await healthy())[0]
    assert 0 < first.observed_memory_mib < booked  # resident memory, read from /proc
    async with aiohttp.ClientSession() as http:
        async def post(path: str) -> int:
            """How many healthy reports there were before the engine was asked to move."""
            before = len(await healthy())
            async with http.post(f"{first.endpoint}{path}") as r:
                assert r.status == 200
            return before

        # Read again while healthy, and reported when it moved by more than 64 MiB: a reading taken
        # while the engine was still growing may be the last reported, up to 64 MiB short.
        seen = await post("/grow?mib=256")
        await reported(lambda mib: mib >= first.observed_memory_mib + 256 - 70, "the grown engine reported", seen)
        await until(lambda: _count(overbooked, 1), "the over-booking")
        seen = await post("/grow?mib=128")
        await reported(lambda mib: mib >= first.observed_memory_mib + 384 - 70, "grown again", seen)
        assert len(await overbooked()) == 1  # still over: the same crossing, not a second event
        seen = await post("/shrink")
        await reported(lambda mib: mib < booked, "back within its booking", seen)
        await post("/grow?mib=256")
        await until(lambda: _count(overbooked, 2), "the second crossing")
    over = await overbooked()
    assert [(e.replica_id, e.node, e.booked_mib, e.source) for e in over] == [("s-r1", NODE, booked, "rss")] * 2
    assert all(e.used_mib > booked * (1 + m.OVERBOOK_MARGIN) for e in over)
    # Only material moves are reported, never the many readings in between.
    figures = [r.observed_memory_mib for r in await healthy()]
    assert all(abs(b - a) > max(64, a // 20) for a, b in zip(figures, figures[1:], strict=False)), figures
    # The fold keeps the last over-booking for status; state_at stays where it turned healthy.
    replica = fold(await control(bus)).replicas["s-r1"]
    assert replica.overbooked == over[-1] and replica.state == "healthy"
    assert replica.state_at == first.at
    assert replica.observed_memory_mib == {NODE: figures[-1]}


async def _count(probe: Callable[[], object], n: int) -> bool:
    return len(await probe()) >= n  # type: ignore[misc, arg-type]


def test_the_fold_takes_an_over_booking_only_from_a_node_the_replica_is_on() -> None:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    p = msgspec.structs.replace(placed("r", spec("x")), at=at)
    ours = m.ReplicaOverBooked(at=at, replica_id="r", model="x", node=NODE, booked_mib=1024, used_mib=2048)
    theirs = m.ReplicaOverBooked(at=at, replica_id="r", model="x", node="n2", booked_mib=1024, used_mib=9999)
    assert fold([p, ours, theirs]).replicas["r"].overbooked == ours
    assert fold([p, theirs]).replicas["r"].overbooked is None
    # A snapshot of the fold carries it.
    state = fold([p, ours])
    again = decode_state(encode_state(state, Cursor()))
    assert again.state.replicas["r"].overbooked == ours
    # What the previous version wrote decodes: the source defaults to NVML's.
    old = (b'{"type":"ReplicaOverBooked","at":"2026-01-01T00:00:00Z","replica_id":"r","model":"x","node":"n1",'
           b'"booked_mib":1,"used_mib":2}')
    assert m.CONTROL_DECODER.decode(old).source == "nvml"  # type: ignore[union-attr]


async def test_a_fake_engine_holds_its_booking_on_the_simulated_gpu(bus: Bus) -> None:
    node = parse(FLEET).node(NODE)
    await deploy(bus, placed("a-r1", spec("a"), mib=3000), placed("b-r1", spec("b"), mib=5000))
    sup = EngineSupervisor(NODE, EngineConfig(simulate=True, health_timeout_s=30))
    agent = Agent(bus, SimNvml(node), NODE, fabric="local", simulated=True, heartbeat_s=0.2, services=(sup,))

    async def healthy() -> dict[str, int]:
        return {r.replica_id: r.observed_memory_mib for r in reports(await control(bus)) if r.state == "healthy"}

    async with running(agent):
        await until(lambda: _count(healthy, 2), "both healthy", limit_s=30)
        procs = {rid: run.proc.pid for rid, run in sup.runs.items() if run.proc is not None}
        sample = await asyncio.to_thread(agent.port.sample, 0)
    assert await healthy() == {"a-r1": 3000, "b-r1": 5000}  # never 0: what each booked
    assert sample is not None and sorted(sample.processes) == sorted(
        [(procs["a-r1"], 3000), (procs["b-r1"], 5000)])  # the simulated driver shows each on the card


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_real_llama_server_on_a_simulated_card_reports_its_resident_memory(bus: Bus, tmp_path: Path) -> None:
    from llama import llama_server_binary

    from llmgw.engine.demomodel import write_demo_model
    from llmgw.planner import load as load_model
    from llmgw.planner import plan

    binary = llama_server_binary()
    # Weights that dominate what llama-server holds on a CPU (35 MB), so that what it holds says something.
    demo = write_demo_model(tmp_path / "mid", layers=8, embd=512, heads=8, kv_heads=8, context=4096)
    node = load(CPU_FLEET).node("cpu-01")
    fleet = fold([inventory(node, datetime(2026, 1, 1, tzinfo=UTC))])
    reply = plan(load_model(str(demo.weights.parent)), fleet,
                 m.PlanRequest(model=str(demo.weights.parent), precisions=("q8_0",), context=512))
    s = next(c for c in reply.candidates if c.fits).spec("mid")
    booked = booking_mib(s, node.gpu_memory_mib)
    ref = m.GpuRef(node=node.name, index=0, uuid=node.gpu_uuid(0), mib=booked)
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=s))
    await bus.publish(m.ReplicaPlaced(at=m.utcnow(), replica_id="mid-r1", model="mid", nodes=(node.name,),
                                      gpus=(ref,), spec=s, fabric=node.fabric))
    cmds = dict(default_commands(), **{"llama.cpp": [str(binary), "-t", "1"]})
    sup = EngineSupervisor(node.name, EngineConfig(cmds=cmds, cpu=True, host="127.0.0.1", health_timeout_s=60))
    agent = Agent(bus, SimNvml(node), node.name, fabric=node.fabric, simulated=True, heartbeat_s=0.2, services=(sup,))

    async def healthy() -> list[m.ReplicaStateChanged]:
        return [r for r in reports(await control(bus), "mid-r1") if r.state == "healthy"]

    async with running(agent):
        await until(healthy, "llama-server healthy", limit_s=60)
        run = sup.runs["mid-r1"]
        assert run.proc is not None
        sample = await asyncio.to_thread(agent.port.sample, 0)
    (state,) = await healthy()
    used = state.observed_memory_mib
    # Its weights are resident (a completion read every layer), and it holds less than the plan booked,
    # which charges a CUDA context (0.5 GiB) that a CPU does not have.
    assert demo.file_bytes >> 20 <= used <= booked, (used, booked, demo.file_bytes)
    assert not [e for e in await control(bus) if isinstance(e, m.ReplicaOverBooked)]
    # The simulated driver shows the same figure for it on its card.
    assert sample is not None and sample.processes == ((run.proc.pid, used),)
