"""``llmgw up`` when its nats-server is SIGKILLed: noticed, restarted on its port and store, nothing spurious."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from faultkit import live_processes
from running import until
from streams import stored

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.bus.server import free_port
from llmgw.config import Settings, credentials_path, read_credentials
from llmgw.errors import BusError, LlmgwError

pytestmark = pytest.mark.slow
LLMGW = str(Path(sys.executable).parent / "llmgw")
LOST_AFTER_S = 4.0
FLEET = """
[[nodes]]
name = "up-a"
fabric = "f"
gpu_class = "A100-40GB"
gpu_count = 1
gpu_memory_mib = 40960

[[nodes]]
name = "up-b"
fabric = "f"
gpu_class = "A100-40GB"
gpu_count = 1
gpu_memory_mib = 40960
"""


def children_named(parent: int, word: bytes) -> list[int]:
    return [p.pid for p in live_processes() if p.ppid == parent and word in p.argv[0]]


async def test_up_restarts_a_killed_nats_server_and_nothing_else_notices(tmp_path: Path,
                                                                         record: Callable[..., None]) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET)
    router_port = free_port()
    up = await asyncio.create_subprocess_exec(
        LLMGW, "up", "--simulate", str(fleet), "--data-dir", str(tmp_path / "data"), "--port", "0", "--no-example",
        "--router-listen", f"127.0.0.1:{router_port}", "--dashboard-listen", "127.0.0.1:0", "--heartbeat-s", "0.2", "--lost-after", f"{LOST_AFTER_S:g}",
        "--router-tick", "0.5", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
    assert up.stdout is not None
    out = up.stdout
    first = (await asyncio.wait_for(out.readline(), 30)).decode()
    lines: list[str] = [first]

    async def read_all() -> None:
        while line := await out.readline():
            lines.append(line.decode(errors="replace"))

    reading = asyncio.create_task(read_all())
    match = re.match(r"nats: (nats://\S+)", first)
    assert match, first
    logins = read_credentials(credentials_path(tmp_path / "data"))  # up's NATS is closed: watch as its admin
    assert logins is not None
    bus = await Bus.connect(Settings(nats_url=match.group(1), user="admin", password=logins[1]["admin"],
                                     connect_timeout_s=2, request_timeout_s=2), "up-watch")
    try:
        async def both_beating() -> bool:
            try:
                beats = await stored(bus, subjects.STREAM_HEARTBEAT, limit_s=5)
            except BusError:  # not declared yet, or the server is away
                return False
            return {e.node for e in beats if isinstance(e, m.HeartbeatSent)} == {"up-a", "up-b"}

        async def router_health() -> str:
            try:
                async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{router_port}/health",
                                                               timeout=aiohttp.ClientTimeout(total=2)) as r:
                    return str((await r.json())["status"])
            except (aiohttp.ClientError, TimeoutError, KeyError):
                return ""

        await until(both_beating, "heartbeats from both simulated nodes", 60, every_s=0.2)
        await until(lambda: router_health_is(router_health, "ok"), "the router ready", 30, every_s=0.2)
        # Every child past its start (the projector and the scheduler declare the streams first).
        logs = tmp_path / "data" / "logs"
        await until(lambda: "waiting for the lease" in read(logs / "scheduler.log"), "the scheduler started", 30)

        async def projector_answers() -> bool:
            try:
                return bool(await bus.request(subjects.STATUS, b"", timeout=2))
            except LlmgwError:
                return False

        await until(projector_answers, "the projector serving status", 30, every_s=0.2)
        fleet_before = await bus.stream_last_seq(subjects.STREAM_FLEET)
        (nats_pid,) = children_named(up.pid, b"nats-server")

        os.kill(nats_pid, signal.SIGKILL)
        await until(lambda: any("nats-server exited" in x for x in lines), "up saying nats-server exited", 10)
        await until(lambda: any("nats-server is back" in x for x in lines), "up restarting nats-server", 20)
        assert await bus.stream_last_seq(subjects.STREAM_FLEET) >= fleet_before  # the same store
        await until(both_beating, "heartbeats after the restart", 30, every_s=0.2)
        await until(lambda: router_health_is(router_health, "ok"), "the router back to ok", 30, every_s=0.2)
        await asyncio.sleep(LOST_AFTER_S * 2)  # time enough for a spurious NodeLost, or a child's exit
        fleet = await stored(bus, subjects.STREAM_FLEET, limit_s=10)
        restarted = children_named(up.pid, b"nats-server")
    finally:
        await bus.close()
        if up.returncode is None:
            os.killpg(up.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(up.wait(), 60)
        except TimeoutError:
            os.killpg(up.pid, signal.SIGKILL)
            await up.wait()
        await asyncio.wait_for(reading, 10)
    text = "".join(lines)
    lost = [e for e in fleet if isinstance(e, m.NodeLost | m.NodeReturned)]
    assert len(restarted) == 1 and restarted[0] != nats_pid, f"nats-server {nats_pid} → {restarted}:\n{text}"
    assert lost == [], f"{lost}:\n{text}"
    # nats-server was the only child that exited: no scheduler (or anything else) gave up with it.
    assert [x for x in lines if " exited (code" in x and not x.startswith("nats-server")] == [], text
    assert up.returncode == 0 and text.rstrip().endswith("stopped"), f"exit {up.returncode}:\n{text}"
    for log in logs.glob("*.log"):
        assert "Traceback" not in log.read_text(errors="replace"), f"{log.name}:\n{log.read_text()[-3000:]}"
    record(nats_restarts=1, node_lost=len(lost))


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


async def router_health_is(health: Callable[[], object], want: str) -> bool:
    got = health()
    return (await got if asyncio.iscoroutine(got) else got) == want
