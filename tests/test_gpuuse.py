"""GPU use from NVML: sampled by the agents (simulated here), carried by heartbeats, summed up by status."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
from projection_events import inventory, small_fleet, t
from running import running, until
from streams import publish, stored

from llmgw import messages as m
from llmgw import subjects
from llmgw.agent.node import Agent, gpu_sample
from llmgw.agent.nvml import GpuUse
from llmgw.agent.runs import EngineConfig
from llmgw.agent.simnvml import IDLE_MIB, SimNvml
from llmgw.agent.supervisor import EngineSupervisor
from llmgw.bus import Bus, RawMsg
from llmgw.fleet.gpuuse import GpuSamples, summarize
from llmgw.fleet.state import fold
from llmgw.fleetfile import load
from llmgw.proc import descendants
from llmgw.projections.runner import Projector

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def beat(node: str, *samples: m.GpuSample, seq: int = 1) -> m.HeartbeatSent:
    return m.HeartbeatSent(at=NOW, node=node, boot_id="b", seq=seq, gpus=samples)


def sample(index: int, util: int | None, used: int | None, total: int | None = 81920) -> m.GpuSample:
    return m.GpuSample(index=index, utilization_pct=util, memory_used_mib=used, memory_total_mib=total,
                       temperature_c=40, power_w=100.0, processes=(m.GpuProcess(pid=7, used_mib=used),))


# --- the schema's bounds ---------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("utilization_pct", 101), ("utilization_pct", -1), ("memory_used_mib", 1 << 40), ("temperature_c", 4000),
    ("power_w", 1e9), ("index", 999),
])
def test_a_heartbeat_with_a_figure_out_of_bounds_is_refused_at_decode(field: str, value: float) -> None:
    good = msgspec.to_builtins(beat("n1", sample(0, 50, 1000)))
    assert m.HEARTBEAT_DECODER.decode(msgspec.json.encode(good)).gpus[0].utilization_pct == 50
    good["gpus"][0][field] = value
    with pytest.raises(msgspec.ValidationError):
        m.HEARTBEAT_DECODER.decode(msgspec.json.encode(good))


def test_too_many_processes_or_gpus_are_refused_and_old_heartbeats_still_decode() -> None:
    many = m.GpuSample(index=0, processes=tuple(m.GpuProcess(pid=i + 1) for i in range(65)))
    with pytest.raises(msgspec.ValidationError, match="length"):
        m.HEARTBEAT_DECODER.decode(m.encode(beat("n1", many)))
    # What the previous version wrote: no samples, no observed memory.
    old = b'{"type":"HeartbeatSent","at":"2026-01-01T00:00:00Z","v":1,"node":"n1","boot_id":"b","seq":3}'
    assert m.HEARTBEAT_DECODER.decode(old).gpus == ()
    state = (b'{"type":"ReplicaStateChanged","at":"2026-01-01T00:00:00Z","replica_id":"r","model":"x",'
             b'"node":"n1","state":"healthy"}')
    assert m.CONTROL_DECODER.decode(state).observed_memory_mib == 0  # type: ignore[union-attr]


def test_the_agent_leaves_a_drivers_odd_readings_unknown_instead_of_refusing_its_heartbeat() -> None:
    odd = GpuUse(index=0, utilization_pct=4294967295, memory_used_mib=-3, memory_total_mib=81559,
                 temperature_c=25, power_w=4294967.295,
                 processes=tuple((pid, pid * 10) for pid in range(1, 40)) + ((0, 5), (9, None)))
    s = gpu_sample(odd)
    assert (s.utilization_pct, s.memory_used_mib, s.memory_total_mib, s.power_w) == (None, None, 81559, None)
    # The largest holders first, at most 16, pid 0 (not a process) left out.
    assert [p.pid for p in s.processes] == list(range(39, 23, -1))
    assert m.HEARTBEAT_DECODER.decode(m.encode(beat("n1", s))).gpus == (s,)


# --- the simulation ------------------------------------------------------------------------


def test_a_simulated_gpu_held_by_an_engine_holds_its_memory_and_the_others_idle(fleet_file: Path) -> None:
    node = load(fleet_file).node("h100-a-01")
    sim = SimNvml(node)
    nobody = 1 << 22  # a pid no process has: no engine answers for it
    sim.engines = lambda: [(nobody, (1, 2), 70_000), (nobody - 1, (5,), 0)]
    use = {i: sim.sample(i) for i in range(node.gpu_count)}
    idle = use[0]
    assert idle is not None and (idle.utilization_pct, idle.memory_used_mib, idle.processes) == (0, IDLE_MIB, ())
    for i in (1, 2):
        held = use[i]
        # Its memory is known; how busy it is only its engine could say, and none answers: unknown, not made up.
        assert held is not None and held.utilization_pct is None
        assert held.memory_used_mib == IDLE_MIB + 70_000 and held.processes == ((nobody, 70_000),)
    unplanned = use[5]
    assert unplanned is not None and unplanned.memory_used_mib == IDLE_MIB + node.gpu_memory_mib * 9 // 10
    sim.inject(3, "lost")
    assert sim.sample(3) is None  # a lost GPU is not sampled
    sim.inject(4, "thermal")
    assert sim.sample(4).temperature_c == 92  # type: ignore[union-attr]


def test_a_simulated_gpu_is_as_busy_as_its_engine_has_requests_in_flight(fleet_file: Path) -> None:
    """Seen (issue 43, finding 9): idle replicas' GPUs read 60-90 %. Now 0 while idle, busy while serving."""
    import threading
    import urllib.request

    from llmgw.engine.fake import spawn

    node = load(fleet_file).node("h100-a-01")
    sim = SimNvml(node)
    import socket

    with socket.socket() as sock:  # a port of its own on its command line, as the agent starts engines
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engine = spawn("m", "--latency-ms", "3000", "--port", str(port))
    try:
        sim.engines = lambda: [(engine.proc.pid, (1,), 70_000)]
        assert sim.sample(1).utilization_pct == 0  # type: ignore[union-attr]
        time.sleep(0.6)
        idle = sim.sample(1)
        assert idle is not None and idle.utilization_pct == 0

        def ask() -> None:
            body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
            req = urllib.request.Request(engine.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=30).read()

        clients = [threading.Thread(target=ask) for _ in range(2)]
        for c in clients:
            c.start()
        time.sleep(1.0)  # both in flight (3 s each)
        busy = sim.sample(1)
        assert busy is not None and busy.utilization_pct is not None and busy.utilization_pct >= 50
        assert busy.power_w > idle.power_w and busy.temperature_c > idle.temperature_c  # type: ignore[operator]
        for c in clients:
            c.join()
        time.sleep(0.6)
        sim.sample(1)  # the period the requests ended in
        time.sleep(0.6)
        assert sim.sample(1).utilization_pct == 0  # type: ignore[union-attr]
    finally:
        engine.stop()


def test_descendants_finds_an_engines_children() -> None:
    import os
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
                              "print(p.pid, flush=True); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        assert descendants([child.pid]) >= {child.pid, grandchild}
        assert os.getpid() not in descendants([child.pid])
    finally:
        os.kill(grandchild, 9)
        child.kill()
        child.wait()
        child.stdout.close()  # type: ignore[union-attr]


async def test_a_simulated_agent_reports_busy_gpus_and_its_engines_memory(bus: Bus, fleet_file: Path) -> None:
    node = load(fleet_file).node("a100-01")
    s = m.ModelSpec(name="qwen", source="Qwen/Qwen2.5-14B-Instruct", precision="bf16", engine="vllm",
                    gpu_class="A100-40GB", context=8192, tp=2, gib_per_gpu=35.5)
    gpus = tuple(m.GpuRef(node=node.name, index=i, uuid=node.gpu_uuid(i)) for i in (2, 3))
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=s))
    await bus.publish(m.ReplicaPlaced(at=m.utcnow(), replica_id="qwen-r1", model="qwen", nodes=(node.name,),
                                      gpus=gpus, spec=s, fabric=node.fabric))
    sup = EngineSupervisor(node.name, EngineConfig(simulate=True, health_timeout_s=20))
    agent = Agent(bus, SimNvml(node), node.name, fabric=node.fabric, simulated=True, heartbeat_s=0.2, services=(sup,))

    async def healthy() -> list[m.ReplicaStateChanged]:
        return [e for e in await stored(bus, subjects.STREAM_CONTROL)
                if isinstance(e, m.ReplicaStateChanged) and e.state == "healthy"]

    seen: list[m.HeartbeatSent] = []

    async def busy_beat() -> bool:
        # The stream keeps the latest heartbeat only: keep the one seen, not a second read.
        seen.extend(e for e in await stored(bus, subjects.STREAM_HEARTBEAT)
                    if isinstance(e, m.HeartbeatSent) and any(g.processes for g in e.gpus)
                    # once the engine serves its /metrics: before, how busy it is is not known
                    and all(g.utilization_pct is not None for g in e.gpus if g.processes))
        return bool(seen)

    async with running(agent):
        await until(healthy, "the fake engine healthy", limit_s=25)
        await until(busy_beat, "a heartbeat with the engine's GPUs busy")
        hb = seen[0]
        proc = sup.runs["qwen-r1"].proc
        assert proc is not None
        pid = proc.pid
    (state,) = await healthy()
    planned = round(35.5 * 1024)
    # NVML's memory of the engine's process, on both its GPUs: what it reserved, observed.
    assert state.observed_memory_mib == 2 * planned
    assert hb is not None and [g.index for g in hb.gpus] == list(range(8))
    for g in hb.gpus:
        if g.index in (2, 3):
            assert g.processes == (m.GpuProcess(pid=pid, used_mib=planned),)
            # Held, and idle: its engine has no request in flight (issue 43, finding 9).
            assert g.memory_used_mib == IDLE_MIB + planned and g.utilization_pct == 0
        else:
            assert (g.utilization_pct, g.memory_used_mib, g.processes) == (0, IDLE_MIB, ())
        assert g.memory_total_mib == node.gpu_memory_mib
    # The fold keeps it per node, for status and `ctl model show`.
    replica = fold(await stored(bus, subjects.STREAM_CONTROL)).replicas["qwen-r1"]  # type: ignore[arg-type]
    assert replica.observed_memory_mib == {node.name: 2 * planned}


def test_the_fold_ignores_an_absurd_observed_memory() -> None:
    s = m.ModelSpec(name="x", source="x", precision="bf16", engine="vllm", gpu_class="H100-80GB", context=1)
    placed = m.ReplicaPlaced(at=NOW, replica_id="r", model="x", nodes=("n1",), gpus=(), spec=s)

    def state(mib: int) -> m.ReplicaStateChanged:
        return m.ReplicaStateChanged(at=NOW, replica_id="r", model="x", node="n1", state="healthy",
                                     observed_memory_mib=mib)

    assert fold([placed, state(5000), state(-1), state(1 << 60), state(0)]).replicas["r"].observed_memory_mib == {"n1": 5000}


# --- status -------------------------------------------------------------------------------------


def test_summary_per_class_and_node_leaves_out_lost_nodes_and_unknown_gpus() -> None:
    state = fold(small_fleet())  # n1..n3 H100 (4 GPUs), n4 L40S (2), n5 lost
    beats = {
        "n1": beat("n1", sample(0, 80, 60_000), sample(1, 20, 1000), sample(9, 99, 99)),  # GPU 9: no such GPU
        "n2": beat("n2", sample(0, None, None)),  # unknown is not idle: counted as sampled, not in the mean
        "n4": beat("n4", sample(0, 50, 40_000, 46_068)),
        "n5": beat("n5", sample(0, 100, 80_000)),  # lost: its last sample says nothing about now
        "ghost": beat("ghost", sample(0, 100, 1)),  # never inventoried
    }
    use, nodes = summarize(state, beats, nodes=True)
    assert use == (
        m.ClassGpuUse(gpu_class="H100-80GB", sampled=3, utilization_pct=50.0, memory_used_mib=61_000,
                      memory_total_mib=2 * 81920),
        m.ClassGpuUse(gpu_class="L40S-48GB", sampled=1, utilization_pct=50.0, memory_used_mib=40_000,
                      memory_total_mib=46_068),
    )
    assert [(n.node, n.gpu_class, [g.index for g in n.gpus]) for n in nodes] == [
        ("n1", "H100-80GB", [0, 1]), ("n2", "H100-80GB", [0]), ("n4", "L40S-48GB", [0])]
    assert all(g.processes == () for n in nodes for g in n.gpus)  # pids stay on the node
    assert summarize(state, beats)[1] == ()


def test_samples_keep_the_newest_per_node_bounded_and_fresh() -> None:
    clock = [10**12]
    samples = GpuSamples(None, max_age_s=60, max_nodes=2, clock_ns=lambda: clock[0])  # type: ignore[arg-type]

    def raw(node: str, ts: int) -> RawMsg:
        return RawMsg(seq=1, subject=subjects.heartbeat(node), data=b"", ts_ns=ts)

    samples.take(raw("a", 10**12), beat("a", seq=2))
    samples.take(raw("a", 10**12 - 5), beat("a", seq=1))  # older: kept out
    samples.take(raw("b", 10**12 - 61 * 10**9), beat("b"))
    samples.take(raw("c", 10**12), beat("c"))  # a third node past max_nodes: dropped, counted
    assert samples.latest["a"][1].seq == 2 and "c" not in samples.latest and samples.dropped == 1
    assert set(samples.fresh()) == {"a"}  # b's is older than a minute


async def test_status_shows_gpu_use_from_the_heartbeat_stream(bus: Bus, tmp_path: Path) -> None:
    await publish(bus, [inventory("n1", "ib-a", 2, t(0)), inventory("n2", "ib-a", 2, t(0))])
    projector = Projector(bus, None)
    task = asyncio.create_task(projector.run_forever())
    try:
        await bus.publish_core(subjects.heartbeat("n1"), m.encode(beat("n1", sample(0, 90, 70_000), sample(1, 10, 4))))
        # A heartbeat that names another node than its subject is not believed.
        await bus.publish_core(subjects.heartbeat("n2"), m.encode(beat("n1", sample(0, 1, 1))))

        async def asked(gpus: bool) -> m.StatusReport:
            data = await bus.request(subjects.STATUS, m.encode(m.StatusRequest(gpus=gpus)), service="projector")
            return m.STATUS_REPORT_DECODER.decode(data)

        async def use_shown() -> bool:
            return bool((await asked(False)).gpu_use) and projector.gpu_samples is not None \
                and projector.gpu_samples.skipped == 1

        await until(use_shown, "GPU use in status")
        plain, full = await asked(False), await asked(True)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert plain.gpu_use == (m.ClassGpuUse(gpu_class="H100-80GB", sampled=2, utilization_pct=50.0,
                                           memory_used_mib=70_004, memory_total_mib=2 * 81920),)
    assert plain.node_gpus == ()  # ctl status does not carry every GPU of the fleet
    assert [n.node for n in full.node_gpus] == ["n1"] and full.gpu_use == plain.gpu_use


def test_one_answer_carries_at_most_node_rows_nodes_but_every_class(monkeypatch: pytest.MonkeyPatch) -> None:
    import llmgw.fleet.gpuuse

    monkeypatch.setattr(llmgw.fleet.gpuuse, "NODE_ROWS", 1)
    state = fold(small_fleet())
    use, nodes = summarize(state, {"n1": beat("n1", sample(0, 10, 1)), "n4": beat("n4", sample(0, 30, 1))}, nodes=True)
    assert [n.node for n in nodes] == ["n1"]  # an answer stays under NATS's payload limit on any fleet
    assert [u.gpu_class for u in use] == ["H100-80GB", "L40S-48GB"]


async def test_a_driver_call_that_hangs_stalls_samples_never_heartbeats(bus: Bus, fleet_file: Path) -> None:
    import threading

    release = threading.Event()

    class Hanging(SimNvml):
        def sample(self, index: int) -> GpuUse | None:
            release.wait(30)  # NVML stuck on a GPU that fell off the bus
            return None

    node = load(fleet_file).node("l40s-01")
    agent = Agent(bus, Hanging(node), node.name, fabric=node.fabric, simulated=True, heartbeat_s=0.05)

    async def beats() -> list[m.HeartbeatSent]:
        return [e for e in await stored(bus, subjects.STREAM_HEARTBEAT) if isinstance(e, m.HeartbeatSent)]

    try:
        async with running(agent):
            await until(lambda: agent.started.is_set(), "the agent")
            first = await bus.stream_last_seq(subjects.STREAM_HEARTBEAT)
            await until(lambda: _later(bus, first + 5), "five more heartbeats while the driver hangs")
    finally:
        release.set()
    (hb,) = await beats()
    assert hb.seq >= 5 and hb.gpus == ()


async def _later(bus: Bus, seq: int) -> bool:
    return await bus.stream_last_seq(subjects.STREAM_HEARTBEAT) >= seq
