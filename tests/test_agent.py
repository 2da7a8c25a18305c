"""The real agent over the simulated NVML backend, against a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner
from running import running, until
from streams import stored

from llmgw import messages as m
from llmgw import subjects
from llmgw.agent.node import Agent, detect_fabric, infiniband_subnet, simulated_agents
from llmgw.agent.nvml import GpuStatic
from llmgw.agent.runs import EngineConfig
from llmgw.agent.simnvml import SimNvml
from llmgw.agent.supervisor import EngineSupervisor
from llmgw.bus import Bus, Outbox
from llmgw.bus.server import EmbeddedServer, port_free
from llmgw.cli.main import cli
from llmgw.config import Settings
from llmgw.engine.argv import parse_engine_cmds
from llmgw.errors import ServiceError
from llmgw.fleet.state import fold
from llmgw.fleetfile import FleetNode, faults, inventory, load, parse

T0 = datetime(2026, 1, 1, tzinfo=UTC)
XID79 = ("xid 79: GPU has fallen off the bus",)
ECC1 = ("uncorrectable ECC errors: 1 since the driver loaded",)
LOST = ("GPU is lost (fell off the bus; NVML_ERROR_GPU_IS_LOST)",)


async def stream_events(bus: Bus, stream: str = subjects.STREAM_FLEET) -> list[m.AnyEvent]:
    return await stored(bus, stream, limit_s=10)


def health_of(events: list[m.AnyEvent]) -> list[tuple[int, bool, tuple[str, ...]]]:
    return [(e.gpu_index, e.healthy, e.reasons) for e in events if isinstance(e, m.GpuHealthChanged)]


def node_a03(fleet_file: Path) -> FleetNode:
    return load(fleet_file).node("h100-a-03")


async def test_inventory_at_start_is_the_full_snapshot_health_included(bus: Bus, fleet_file: Path) -> None:
    node = node_a03(fleet_file)
    agent = Agent(bus, SimNvml(node), node.name, fabric=node.fabric, fabric_source="fleet-file",
                  simulated=True, boot_id="boot-1", now=lambda: T0)
    async with running(agent):
        await agent.outbox.flush()
    inv = inventory(node, T0, boot_id="boot-1")
    expected = msgspec.structs.replace(
        inv, driver_version="simulated",
        gpus=tuple(msgspec.structs.replace(g, nvlink_active_links=18) for g in inv.gpus),
    )
    assert await stream_events(bus) == [expected]
    assert [g.healthy for g in expected.gpus] == [True, True, True, False, True, True, True, True]


async def test_injected_faults_publish_only_transitions_and_recovery(bus: Bus, settings: Settings, fleet_file: Path) -> None:
    node = node_a03(fleet_file)
    agent = Agent(bus, SimNvml(node), node.name, fabric=node.fabric, fabric_source="fleet-file", simulated=True)
    async with running(agent):
        # Through the CLI and NATS request/reply, exactly as an operator does it.
        result = await asyncio.to_thread(
            CliRunner().invoke, cli, ["agent", "fault", node.name, "1", "xid=79", "--nats-url", settings.nats_url]
        )
        assert result.exit_code == 0, result.output
        assert result.output == "h100-a-03 GPU 1: UNHEALTHY (xid 79: GPU has fallen off the bus)\n"
        again = await agent.inject(1, "xid", 79)
        assert not again.changed  # an unchanged state publishes nothing
        assert (await agent.inject(1, "clear")).healthy
        await agent.inject(2, "ecc")
        await agent.inject(4, "lost")
        await agent.inject(5, "thermal")
        app = await agent.inject(6, "xid", 13)
        assert app.healthy and app.changed
        for gpu in (2, 4, 5):
            await agent.inject(gpu, "clear")
        await agent.outbox.flush()
    events = await stream_events(bus)
    assert isinstance(events[0], m.NodeInventoryReported) and len(events) == 10
    app_reason = ("xid 13: graphics engine exception (application fault; GPU stays usable)",)
    assert health_of(events) == [
        (1, False, XID79),
        (1, True, ()),
        (2, False, ECC1),
        (4, False, LOST),
        (5, False, ("thermal slowdown",)),
        (6, True, app_reason),
        (2, True, ()),
        (4, True, ()),
        (5, True, ()),
    ]
    assert {e.boot_id for e in events if isinstance(e, m.GpuHealthChanged)} == {agent.boot_id}


async def test_heartbeats_go_to_their_own_stream_not_history(bus: Bus, fleet_file: Path) -> None:
    node = node_a03(fleet_file)
    agent = Agent(bus, SimNvml(node), node.name, fabric=node.fabric, simulated=True, heartbeat_s=0.05)

    async def three_beats() -> bool:
        return await bus.stream_last_seq(subjects.STREAM_HEARTBEAT) >= 3

    async with running(agent):
        await until(three_beats, "three heartbeats")
        await agent.outbox.flush()
    fleet = await stream_events(bus)
    assert [type(e) for e in fleet] == [m.NodeInventoryReported]
    beats = await stream_events(bus, subjects.STREAM_HEARTBEAT)
    assert len(beats) == 1  # the stream keeps only the latest per node
    (hb,) = beats
    assert isinstance(hb, m.HeartbeatSent) and hb.node == node.name and hb.boot_id == agent.boot_id and hb.seq >= 3


async def test_restarted_agent_replaces_the_node_without_double_counting(bus: Bus, fleet_file: Path) -> None:
    node = node_a03(fleet_file)
    first = Agent(bus, SimNvml(node), node.name, fabric=node.fabric, simulated=True)
    async with running(first):
        await first.inject(1, "xid", 79)
        await first.inject(2, "ecc")  # read from the GPU, not remembered: a new reading decides
        await first.outbox.flush()
    second = Agent(bus, SimNvml(node), node.name, fabric=node.fabric, simulated=True)
    async with running(second):
        await second.outbox.flush()
    assert first.boot_id != second.boot_id
    events = await stream_events(bus)
    assert [type(e) for e in events] == [m.NodeInventoryReported, m.GpuHealthChanged, m.GpuHealthChanged,
                                         m.NodeInventoryReported]
    state = fold(events)
    view = state.nodes[node.name]
    assert len(state.nodes) == 1 and len(view.gpus) == 8 and view.boot_id == second.boot_id
    # XID 79 arrived as a driver event the new agent never saw: the fleet stream remembers it.
    assert [i for i, g in view.gpus.items() if not g.healthy] == [1, 3]
    assert view.gpus[1].reasons == XID79


async def test_a_remembered_fault_stays_until_cleared_and_the_clear_is_remembered_too(bus: Bus, fleet_file: Path) -> None:
    node = node_a03(fleet_file)
    async with running(Agent(bus, SimNvml(node), node.name, simulated=True)) as first:
        await first.inject(5, "xid", 79)
        await first.inject(6, "xid", 13)  # the application's own fault: reported, never fencing
        await first.outbox.flush()
    async with running(Agent(bus, SimNvml(node), node.name, simulated=True, poll_s=0.1)) as second:
        assert second.inventory is not None
        assert [(g.index, g.healthy, g.reasons) for g in second.inventory.gpus if g.reasons and g.index != 3] == [
            (5, False, XID79),
            (6, True, ("xid 13: graphics engine exception (application fault; GPU stays usable)",)),
        ]
        await asyncio.sleep(0.3)  # a poll or two: nothing reads the fault away
        assert second.health(5) == (False, XID79)
        cleared = await second.inject(5, "clear")
        assert cleared.healthy and cleared.changed
        await second.outbox.flush()
    async with running(Agent(bus, SimNvml(node), node.name, simulated=True, poll_s=0.1)) as third:
        assert third.health(5) == (True, ())
        await third.outbox.flush()


class RealLike:
    """The simulated GPUs behind a port that takes no injected faults, as real NVML does not."""

    def __init__(self, node: FleetNode) -> None:
        self._sim = SimNvml(node)
        self.open, self.close, self.driver_version = self._sim.open, self._sim.close, self._sim.driver_version
        self.gpus, self.health, self.wait_event = self._sim.gpus, self._sim.health, self._sim.wait_event


async def test_an_operator_clears_a_remembered_xid_on_a_real_nvml_agent(bus: Bus, settings: Settings,
                                                                         fleet_file: Path) -> None:
    node = node_a03(fleet_file)
    async with running(Agent(bus, SimNvml(node), node.name, simulated=True)) as first:
        await first.inject(2, "xid", 79)
        await first.outbox.flush()
    async with running(Agent(bus, RealLike(node), node.name)) as real:  # type: ignore[arg-type]
        assert real.health(2) == (False, XID79)
        refused = await asyncio.to_thread(
            CliRunner().invoke, cli, ["agent", "fault", node.name, "2", "ecc", "--nats-url", settings.nats_url])
        assert refused.exit_code == 1 and "faults can only be injected into --simulate agents" in refused.output
        result = await asyncio.to_thread(
            CliRunner().invoke, cli, ["agent", "fault", node.name, "2", "clear", "--nats-url", settings.nats_url])
        assert result.exit_code == 0, result.output
        assert result.output == "h100-a-03 GPU 2: healthy\n"
        await real.outbox.flush()
    assert health_of(await stream_events(bus))[-1] == (2, True, ())


async def test_bad_fault_requests_get_error_replies_and_the_agent_lives_on(bus: Bus, fleet_file: Path) -> None:
    node = node_a03(fleet_file)
    agent = Agent(bus, SimNvml(node), node.name, fabric=node.fabric, simulated=True)
    subject = subjects.agent_fault(node.name)
    async with running(agent):
        with pytest.raises(ServiceError, match="h100-a-03 has GPUs 0 to 7, not 9"):
            await bus.request(subject, m.encode(m.InjectFault(node=node.name, gpu=9, kind="ecc")))
        with pytest.raises(ServiceError, match="unknown fault 'melt'"):
            await bus.request(subject, m.encode(m.InjectFault(node=node.name, gpu=0, kind="melt")))
        with pytest.raises(ServiceError, match="refused the request"):
            await bus.request(subject, b"not json")
        reply = msgspec.json.decode(
            await bus.request(subject, m.encode(m.InjectFault(node=node.name, gpu=0, kind="ecc"))), type=m.FaultInjected
        )
        assert (reply.gpu, reply.healthy, reply.reasons, reply.changed) == (0, False, ECC1, True)


async def test_fault_schedule_from_the_fleet_file(bus: Bus, fleet_file: Path, tmp_path: Path) -> None:
    text = await asyncio.to_thread(fleet_file.read_text)
    text += (
        '\n[[faults]]\nnode = "h100-a-01"\ngpu = 5\nafter_s = 0.1\nkind = "xid=79"\nclear_after_s = 0.2\n'
    )
    fleet = parse(text, str(tmp_path / "fleet.toml"))
    node = fleet.node("h100-a-01")
    agent = Agent(bus, SimNvml(node), node.name, fabric=node.fabric, simulated=True, faults=faults(fleet))

    async def three_events() -> bool:
        return await bus.stream_last_seq(subjects.STREAM_FLEET) >= 3

    async with running(agent):
        await until(three_events, "the scheduled fault and its clearing")
    assert health_of(await stream_events(bus)) == [(5, False, XID79), (5, True, ())]


def test_fabric_detection_order(tmp_path: Path) -> None:
    gpus = [GpuStatic(index=0, uuid="u", name="n", memory_mib=1, fabric_cluster_uuid="c-1", fabric_clique_id=3)]
    plain = [GpuStatic(index=0, uuid="u", name="n", memory_mib=1)]
    port = tmp_path / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    (port / "gids").mkdir(parents=True)
    (port / "gids" / "0").write_text("fe80:0000:0000:0001:0c42:a103:0012:3456\n")
    (port / "link_layer").write_text("InfiniBand\n")
    roce = tmp_path / "class" / "infiniband" / "mlx5_1" / "ports" / "1"
    (roce / "gids").mkdir(parents=True)
    (roce / "gids" / "0").write_text("fe80:0000:0000:0000:aaaa:bbbb:cccc:dddd\n")
    (roce / "link_layer").write_text("Ethernet\n")
    assert detect_fabric("gpu-01", "ib-a", gpus, tmp_path) == ("ib-a", "flag")
    assert detect_fabric("gpu-01", None, gpus, tmp_path) == ("nvl-c-1-3", "nvml-fabric")
    assert detect_fabric("gpu-01", None, plain, tmp_path) == ("ib-fe80000000000001", "infiniband")
    assert infiniband_subnet(tmp_path / "nowhere") == ""
    assert detect_fabric("gpu-01", None, plain, tmp_path / "nowhere") == ("gpu-01", "default")


def _free_port() -> int:
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port_free("127.0.0.1", port):
            return int(port)
    raise AssertionError("no free port")


@pytest.mark.slow
async def test_nats_outage_loses_and_doubles_nothing(fleet_file: Path) -> None:
    """Kill the server under a running agent, change health meanwhile, restart: each event once, in order."""
    store = Path(tempfile.mkdtemp(prefix="llmgw-agent-outage-"))
    server = EmbeddedServer(store, port=_free_port()).start()
    settings = Settings(nats_url=server.url)
    bus = await Bus.connect(settings, "outage-agent")
    try:
        await bus.ensure_streams()
        node = node_a03(fleet_file)
        agent = Agent(bus, SimNvml(node), node.name, fabric=node.fabric, simulated=True, heartbeat_s=0.2)
        async with running(agent):
            await agent.outbox.flush()
            server.kill()
            await agent.inject(0, "xid", 79)
            await agent.inject(1, "ecc")
            await agent.inject(0, "clear")
            await agent.inject(2, "lost")
            await agent.inject(2, "clear")
            await agent.inject(1, "clear")
            assert len(agent.outbox) == 6  # held, in order, while NATS is away
            server.start()
            await agent.outbox.flush(timeout=30)
        events = await stream_events(bus)
    finally:
        await bus.close()
        server.stop()
        shutil.rmtree(store, ignore_errors=True)
    assert [type(e) for e in events] == [m.NodeInventoryReported] + [m.GpuHealthChanged] * 6
    assert health_of(events) == [
        (0, False, XID79), (1, False, ECC1), (0, True, ()), (2, False, LOST), (2, True, ()), (1, True, ()),
    ]


async def test_cli_once_prints_and_publishes_the_inventory(bus: Bus, settings: Settings, fleet_file: Path) -> None:
    args = ["agent", "--simulate", str(fleet_file), "--node", "l40s-02", "--fabric", "eth-x", "--once", "--json",
            "--engines", "real", "--engine-cmd", "vllm=/opt/vllm/bin/vllm", "--nats-url", settings.nats_url]
    result = await asyncio.to_thread(CliRunner().invoke, cli, args)
    assert result.exit_code == 0, result.output
    printed = msgspec.json.decode(result.output.encode(), type=m.NodeInventoryReported)
    assert (printed.node, printed.fabric, printed.fabric_source, len(printed.gpus)) == ("l40s-02", "eth-x", "flag", 4)
    assert {g.gpu_class for g in printed.gpus} == {"L40S-48GB"}
    assert await stream_events(bus) == [printed]


async def test_cli_rejects_a_bad_engine_cmd_and_a_bad_fleet_file(tmp_path: Path, settings: Settings) -> None:
    bad = tmp_path / "fleet.toml"
    bad.write_text('[[nodes]]\nname = "n1"\nfabric = "a"\ngpu_class = "H100-80GB"\ngpu_count = 0\ngpu_memory_mib = 81559\n')
    result = await asyncio.to_thread(CliRunner().invoke, cli, ["agent", "--simulate", str(bad), "--nats-url", settings.nats_url])
    assert (result.exit_code, result.output) == (1, f"Error: {bad}: nodes[0].gpu_count must be a positive integer of at most 64 (got 0)\n")
    result = await asyncio.to_thread(CliRunner().invoke, cli, ["agent", "--simulate", str(bad), "--engine-cmd", "vllm"])
    assert result.exit_code == 2 and "expected ENGINE=CMD" in result.output


@pytest.mark.parametrize(("args", "message"), [
    # Simulated nodes run fake engines: a real engine's program next to them would go unused.
    (["--engine-cmd", "llama.cpp=/opt/llama-server"], "unless you add --engines real"),
    (["--engines", "fake", "--engine-cmd", "vllm=/opt/vllm/bin/vllm"], "unless you add --engines real"),
])
async def test_cli_refuses_an_engine_cmd_it_would_ignore(fleet_file: Path, settings: Settings, args: list[str],
                                                         message: str) -> None:
    result = await asyncio.to_thread(CliRunner().invoke, cli, ["agent", "--simulate", str(fleet_file), *args,
                                                               "--once", "--nats-url", settings.nats_url])
    assert result.exit_code == 2 and message in result.output, result.output
    result = await asyncio.to_thread(CliRunner().invoke, cli, ["agent", "--engines", "fake", "--once"])
    assert result.exit_code == 2 and "--engines fake runs on simulated GPUs only" in result.output


async def test_simulated_agents_cover_the_fleet_file(bus: Bus, fleet_file: Path) -> None:
    text = await asyncio.to_thread(fleet_file.read_text)
    fleet = parse(text + '\n[[faults]]\nnode = "a100-02"\ngpu = 1\nafter_s = 1\nkind = "ecc"\n', "f.toml")
    agents = simulated_agents(bus, fleet)
    assert [a.node for a in agents] == [n.name for n in fleet.nodes]
    assert {a.node: len(a.faults) for a in agents if a.faults} == {"a100-02": 1}
    assert {a.fabric_source for a in agents} == {"fleet-file"}


async def test_attached_services_run_beside_the_agent_and_stop_with_it(bus: Bus, fleet_file: Path) -> None:
    node = node_a03(fleet_file)
    seen: list[str] = []

    async def service(b: Bus, outbox: Outbox) -> None:
        seen.append("started")
        assert b is bus
        outbox.put(m.ReplicaStateChanged(at=T0, replica_id="r1", model="m", node=node.name, state="starting"),
                   msg_id=f"ReplicaStateChanged:{node.name}:r1:1")
        try:
            await asyncio.Event().wait()
        finally:
            seen.append("cancelled")

    agent = Agent(bus, SimNvml(node), node.name, fabric=node.fabric, simulated=True, services=[service])
    async with running(agent):
        async def delivered() -> bool:
            return await bus.stream_last_seq(subjects.STREAM_CONTROL) == 1

        await until(delivered, "the service's event through the agent's outbox")
    assert seen == ["started", "cancelled"]


# `vllm --version` imports all of vLLM (10–25 s, more under load): this one answers once the test says so,
# and notes each time it is asked.
SLOW_VLLM = """#!{python}
import pathlib, sys, time
here = pathlib.Path(sys.argv[0]).parent
with open(here / "asked", "a") as f:
    f.write("asked\\n")
while not (here / "gate").exists():
    time.sleep(0.05)
print("INFO 01-01 00:00:00 [__init__.py:235] Automatically detected platform cuda.")
print("0.32.0")
"""


def slow_vllm(tmp_path: Path) -> EngineSupervisor:
    """A supervisor whose vLLM answers its --version only after ``tmp_path/gate`` exists (no llama.cpp)."""
    vllm = tmp_path / "vllm"
    if not vllm.exists():  # written again, it would be another program (its mtime)
        vllm.write_text(SLOW_VLLM.format(python=sys.executable))
        vllm.chmod(0o755)
    cmds = parse_engine_cmds([f"vllm={vllm}", "llama.cpp=/nonexistent/llama-server"])
    return EngineSupervisor("h100-a-03", EngineConfig(cmds=cmds, version_cache=tmp_path / "versions.json"))


async def test_a_slow_version_probe_holds_back_no_heartbeat_and_its_answer_is_published(
        bus: Bus, fleet_file: Path, tmp_path: Path) -> None:
    node = node_a03(fleet_file)

    def agent(boot: str) -> Agent:
        return Agent(bus, SimNvml(node), node.name, fabric=node.fabric, boot_id=boot, heartbeat_s=0.2,
                     services=[slow_vllm(tmp_path)])

    async def inventories() -> list[m.NodeInventoryReported]:
        return [e for e in await stream_events(bus) if isinstance(e, m.NodeInventoryReported)]

    async def beating() -> bool:
        return await bus.stream_last_seq(subjects.STREAM_HEARTBEAT) >= 1

    async with running(agent("boot-1")):
        await until(beating, "a heartbeat while vllm --version has not answered")
        assert [i.vllm_version for i in await inventories()] == [""]
        (tmp_path / "gate").touch()

        async def versioned() -> bool:
            return any(i.vllm_version for i in await inventories())
        await until(versioned, "the inventory again, with the version", limit_s=20)
    first, second = await inventories()
    assert (second.boot_id, second.vllm_version, second.gpus) == ("boot-1", "0.32.0", first.gpus)

    # The agent's next start: the same binary, so its first inventory carries the version, unasked.
    (tmp_path / "gate").unlink()
    async with running(agent("boot-2")) as again:
        await again.outbox.flush()
    assert [(i.boot_id, i.vllm_version) for i in await inventories()][2:] == [("boot-2", "0.32.0")]
    assert (tmp_path / "asked").read_text().count("asked") == 1


async def test_a_version_probe_that_gives_up_says_so_and_a_changed_program_is_asked_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sup = slow_vllm(tmp_path)
    vllm = tmp_path / "vllm"

    def asked() -> int:
        return (tmp_path / "asked").read_text().count("asked")

    def probing() -> bool:
        """A probe of this test's vllm still running."""
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            with contextlib.suppress(OSError):
                if str(vllm).encode() in cmdline.read_bytes():
                    return True
        return False

    with caplog.at_level("WARNING", logger="llmgw.agent.supervisor"):
        assert await sup.versions(timeout_s=0.5) == {}
    assert f"`{vllm} --version` did not answer within 0.5s" in caplog.text
    assert not probing()  # killed when given up on, not left to finish
    (tmp_path / "gate").touch()
    assert await sup.versions() == {"vllm": "0.32.0"} == await sup.versions()
    assert asked() == 2  # the answer is kept; a timeout was not
    stat = vllm.stat()
    os.utime(vllm, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # an upgrade rewrites it
    assert await sup.versions() == {"vllm": "0.32.0"} and asked() == 3

    vllm.write_text(f"#!{sys.executable}\nimport sys\nprint('ImportError: libcudart.so.12')\nsys.exit(1)\n")
    caplog.clear()
    with caplog.at_level("WARNING", logger="llmgw.agent.supervisor"):
        assert await sup.versions() == {}
    assert "exited 1 and printed no version (last: ImportError: libcudart.so.12)" in caplog.text

