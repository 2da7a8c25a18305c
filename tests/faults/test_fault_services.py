"""Our own services as child processes, logged in with their nats.conf roles, while the server restarts."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from faultkit import tables
from running import until

from llmgw import fleetfile, subjects
from llmgw import messages as m
from llmgw.bus import Bus, RawMsg, natsconf
from llmgw.bus.server import EmbeddedServer, free_port
from llmgw.config import Settings

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
FLEET_FILE = ROOT / "examples" / "fleet.toml"
NODES = [n.name for n in fleetfile.load(FLEET_FILE).nodes]
LLMGW = str(Path(sys.executable).parent / "llmgw")
NODE = "h100-a-01"


class Plane:
    """A nats-server with the rendered nats.conf, and children logged in as their roles."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        conf = tmp / "nats.conf"
        conf.write_text(natsconf.render(NODES, store_dir=str(tmp / "js")))
        self.passwords = natsconf.make_passwords(NODES)
        self.server = EmbeddedServer(tmp / "data", port=free_port(), config_file=conf, env=self.passwords,
                                     extra_args=("-m", "0"))
        self.procs: dict[str, asyncio.subprocess.Process] = {}

    def settings(self, user: str) -> Settings:
        return Settings(nats_url=self.server.url, user=user, password=self.passwords[natsconf.password_env(user)],
                        connect_timeout_s=2, request_timeout_s=5)

    def env(self, user: str) -> dict[str, str]:
        return {**os.environ, "LLMGW_NATS_URL": self.server.url, "LLMGW_NATS_USER": user,
                "LLMGW_NATS_PASSWORD": self.passwords[natsconf.password_env(user)]}

    async def spawn(self, name: str, user: str, *args: str) -> None:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115, ASYNC230 - handed to the child
        self.procs[name] = await asyncio.create_subprocess_exec(LLMGW, *args, env=self.env(user), stdout=log, stderr=log)
        log.close()

    async def run(self, user: str, *args: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(LLMGW, *args, env=self.env(user), stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode or 0, out.decode()

    async def stop_all(self) -> dict[str, int | None]:
        for p in self.procs.values():
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for name, p in self.procs.items():
            try:
                codes[name] = await asyncio.wait_for(p.wait(), 20)
            except TimeoutError:
                p.kill()
                codes[name] = await p.wait()
        return codes

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")


async def read_all(bus: Bus, stream: str) -> list[RawMsg]:
    last = await bus.stream_last_seq(stream)
    out: list[RawMsg] = []
    if last:
        async with asyncio.timeout(30):
            async for batch in bus.reader(stream, 1, stop_at=last).batches():
                out += batch
    return out


async def test_server_sigkill_under_agent_router_projector(tmp_path: Path, record: Callable[..., None]) -> None:
    plane = Plane(tmp_path)
    plane.server.start()
    admin = await Bus.connect(plane.settings("admin"), "fault-admin")
    cli = await Bus.connect(plane.settings("cli"), "fault-cli")
    live, clean = tmp_path / "live.duckdb", tmp_path / "clean.duckdb"
    try:
        # Admin declares the streams (compose.yaml's `streams` service); the roles only find them.
        rc, out = await plane.run("admin", "declare-streams")
        assert rc == 0, out
        await plane.spawn("projector", "projector", "project", "--db", str(live), "--analysts-copy-interval", "0",
                          "--commit-interval", "0.2")
        await plane.spawn("agent", f"agent-{NODE}", "agent", "--simulate", str(FLEET_FILE), "--node", NODE,
                          "--heartbeat-s", "0.5", "--poll-s", "0.5")
        await plane.spawn("router", "router", "router", "--listen", f"127.0.0.1:{free_port()}", "--name", "gw-1",
                          "--tick", "0.3")

        async def usage_at_least(k: int) -> bool:
            return await admin.stream_last_seq(subjects.STREAM_USAGE) >= k

        async def fleet_has_inventory() -> bool:
            return await admin.stream_last_seq(subjects.STREAM_FLEET) >= 1

        await until(fleet_has_inventory, "the agent's inventory", 60, every_s=0.2)
        await until(lambda: usage_at_least(3), "three idle maps", 60, every_s=0.2)
        usage_before = await admin.stream_last_seq(subjects.STREAM_USAGE)

        plane.server.kill()  # SIGKILL under all three
        await asyncio.sleep(1.5)
        plane.server.start()

        await until(lambda: usage_at_least(usage_before + 5), "idle maps after the restart", 60, every_s=0.2)
        rc, out = await plane.run("cli", "agent", "fault", NODE, "2", "xid=79", "--json")
        assert rc == 0, out

        async def health_stored() -> bool:
            return any(isinstance(e := m.decode_event(x.data), m.GpuHealthChanged) and e.gpu_index == 2
                       for x in await read_all(admin, subjects.STREAM_FLEET))

        await until(health_stored, "the injected fault's GpuHealthChanged", 30, every_s=0.2)
        want = {s: await admin.stream_last_seq(s) for s in (subjects.STREAM_FLEET, subjects.STREAM_USAGE)}

        async def projector_caught_up() -> bool:
            try:
                rep = m.STATUS_REPORT_DECODER.decode(await cli.request(subjects.STATUS, b"", timeout=5))
            except Exception:  # noqa: BLE001 - the projector may still be reconnecting
                return False
            return all(rep.positions.get(s, 0) >= v for s, v in want.items())

        await until(projector_caught_up, "the projector folding past the restart", 60, every_s=0.2)
        codes = await plane.stop_all()
        fleet = [m.decode_event(x.data) for x in await read_all(admin, subjects.STREAM_FLEET)]
        usage = [m.decode_event(x.data) for x in await read_all(admin, subjects.STREAM_USAGE)]
        assert (await plane.run("projector", "project", "--once", "--db", str(live)))[0] == 0
        assert (await plane.run("projector", "project", "--once", "--db", str(clean)))[0] == 0
    finally:
        await plane.stop_all()
        await cli.close()
        await admin.close()
        plane.server.stop()

    logs = {name: plane.log(name) for name in plane.procs}
    inventories = Counter((e.node, e.boot_id) for e in fleet if isinstance(e, m.NodeInventoryReported))
    faults = [e for e in fleet if isinstance(e, m.GpuHealthChanged) and e.gpu_index == 2]
    ticks = Counter((e.router, e.boot_id, e.tick) for e in usage if isinstance(e, m.IdleMapPublished))
    tick_numbers = sorted(t for (_, _, t) in ticks)
    assert all(v == 1 for v in inventories.values()) and set(inventories) == {(NODE, next(iter(inventories))[1])}
    assert len(faults) == 1 and not faults[0].healthy
    assert all(v == 1 for v in ticks.values())  # no idle map stored twice
    assert tables(live) == tables(clean)
    for name, text in logs.items():
        assert "permissions violation" not in text.lower(), f"{name} was refused by nats.conf:\n{text[-2000:]}"
        assert "Traceback" not in text, f"{name}:\n{text[-2000:]}"
    # The router installs no SIGTERM handler (cli/router.py), so it ends by the signal itself.
    assert codes["projector"] == 0 and codes["agent"] == 0 and codes["router"] in (0, -signal.SIGTERM), codes
    record(fleet_events=len(fleet), usage_events=len(usage), inventories=sum(inventories.values()),
           injected_faults_stored=len(faults), idle_map_duplicates=sum(v - 1 for v in ticks.values()),
           idle_ticks_skipped_during_outage=tick_numbers[-1] - tick_numbers[0] + 1 - len(tick_numbers),
           exit_codes=codes)
