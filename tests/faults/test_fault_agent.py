"""An agent process killed with SIGKILL: its engines die with it, and the next agent runs each replica once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from faultkit import alive, live_processes
from running import until
from streams import stored

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.config import Settings

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
FLEET_FILE = ROOT / "examples" / "fleet.toml"
LLMGW = str(Path(sys.executable).parent / "llmgw")
NODE = "h100-a-01"


def engine_pids(replica_id: str) -> list[int]:
    """Live fake-engine processes serving ``replica_id``."""
    return [p.pid for p in live_processes() if b"fake-engine" in p.argv and replica_id.encode() in p.argv]


async def healthy_reports(bus: Bus, replica_id: str) -> int:
    return sum(1 for e in await stored(bus, subjects.STREAM_CONTROL, limit_s=10)
               if isinstance(e, m.ReplicaStateChanged) and e.replica_id == replica_id and e.state == "healthy")


async def start_agent(settings: Settings, log: Path) -> asyncio.subprocess.Process:
    with open(log, "ab") as out:  # noqa: ASYNC230 - handed to the child
        return await asyncio.create_subprocess_exec(
            LLMGW, "agent", "--simulate", str(FLEET_FILE), "--node", NODE, "--heartbeat-s", "1",
            "--nats-url", settings.nats_url, stdout=out, stderr=out, stdin=asyncio.subprocess.DEVNULL)


async def test_sigkilled_agent_takes_its_engines_along_and_the_next_runs_one(
        bus: Bus, settings: Settings, tmp_path: Path, record: Callable[..., None]) -> None:
    rid = f"fk-{uuid.uuid4().hex[:8]}-r1"  # unique: other tests' engines are never counted
    spec = m.ModelSpec(name="fk", source="Qwen/Qwen2.5-0.5B-Instruct", precision="bf16", engine="vllm",
                       gpu_class="H100-80GB", context=4096, tp=1)
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec))
    await bus.publish(m.ReplicaPlaced(at=m.utcnow(), replica_id=rid, model="fk", nodes=(NODE,),
                                      gpus=(m.GpuRef(node=NODE, index=0, uuid="GPU-0"),), spec=spec, fabric="ib-a"))
    log = tmp_path / "agent.log"
    agents: list[asyncio.subprocess.Process] = []
    try:
        agents.append(await start_agent(settings, log))
        await until(lambda: healthy_reports(bus, rid), "the first agent's engine healthy", 30, every_s=0.2)
        (first_engine,) = engine_pids(rid)

        agents[0].send_signal(signal.SIGKILL)
        await agents[0].wait()
        await until(lambda: not alive(first_engine), "the engine to die with its agent", 5, every_s=0.05)

        agents.append(await start_agent(settings, log))

        async def healthy_again() -> bool:
            return await healthy_reports(bus, rid) >= 2

        await until(healthy_again, "the restarted agent's engine healthy", 30, every_s=0.2)
        running_now = engine_pids(rid)
    finally:
        for p in agents:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(p.wait(), 15)
                except TimeoutError:
                    p.kill()
                    await p.wait()
        for pid in engine_pids(rid):  # never leave a stray engine behind a failed run
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert len(running_now) == 1 and running_now[0] != first_engine, (running_now, log.read_text()[-2000:])
    assert engine_pids(rid) == []  # and a clean stop takes that one along too
    record(engines_after_restart=len(running_now))
