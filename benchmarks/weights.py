"""Wake time with the files on the node against wakes that fetch them first, on a real llama-server.

    python benchmarks/weights.py [--rounds 5] [--rate-mib 20] [--layers 8] [--embd 512]

An embedded nats-server, one simulated node (examples/cpu.toml) whose agent keeps its files,
and a real llama-server (scripts/llama-server.sh, or $LLMGW_LLAMA_SERVER) on the demo model's
GGUF, served by the stand-in hub (tests/hubserver.py) at ``--rate-mib`` MiB a second. Each round
wakes the model twice, as the scheduler places a wake: once with its GGUF on the node, once after
deleting it (the agent fetches and verifies it first). The figures are the cold-start ledger's
own (``ModelHistory.cold_starts`` over the control stream): placed → healthy, p50 and p95 of each
kind, and the download phase.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from hubserver import Hub, Repo, serving  # noqa: E402

from llmgw import messages as m  # noqa: E402
from llmgw import subjects  # noqa: E402
from llmgw.agent.downloads import FileKeeper, FilesConfig  # noqa: E402
from llmgw.agent.node import Agent  # noqa: E402
from llmgw.agent.runs import EngineConfig  # noqa: E402
from llmgw.agent.simnvml import SimNvml  # noqa: E402
from llmgw.agent.supervisor import EngineSupervisor  # noqa: E402
from llmgw.bus import Bus  # noqa: E402
from llmgw.bus.server import EmbeddedServer  # noqa: E402
from llmgw.config import Settings  # noqa: E402
from llmgw.engine.argv import default_commands  # noqa: E402
from llmgw.engine.demomodel import write_demo_model  # noqa: E402
from llmgw.fleet import percentile  # noqa: E402
from llmgw.fleet.history import ModelHistory  # noqa: E402
from llmgw.fleetfile import load  # noqa: E402

SOURCE = "acme/demo-GGUF"


def llama_server() -> str:
    given = os.environ.get("LLMGW_LLAMA_SERVER")
    if given:
        return given
    out = subprocess.run(["bash", str(ROOT / "scripts" / "llama-server.sh")], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


async def wake(bus: Bus, sup: EngineSupervisor, spec: m.ModelSpec, node: str, uuid: str, rid: str) -> None:
    ref = m.GpuRef(node=node, index=0, uuid=uuid, mib=1024)
    await bus.publish(m.ReplicaPlaced(at=m.utcnow(), replica_id=rid, model=spec.name, nodes=(node,), gpus=(ref,),
                                      spec=spec, cause="wake", reason="woken by bench: 1 request waiting"))
    async with asyncio.timeout(300):
        while (run := sup.runs.get(rid)) is None or run.state != "healthy":
            if run is not None and run.state == "failed":
                raise SystemExit(f"{rid} failed: {run.tail[-1] if run.tail else ''}")
            await asyncio.sleep(0.02)
    await bus.publish(m.ReplicaStopped(at=m.utcnow(), replica_id=rid, model=spec.name, reason="bench", code="idle"))
    async with asyncio.timeout(60):
        while not gone(sup, rid):  # noqa: ASYNC110 - the supervisor's state, polled as a reader would
            await asyncio.sleep(0.05)


def gone(sup: EngineSupervisor, rid: str) -> bool:
    run = sup.runs.get(rid)
    return run is None or run.proc is None or run.proc.returncode is not None


async def main_async(args: argparse.Namespace, tmp: Path) -> None:
    binary = llama_server()
    demo = write_demo_model(tmp / "demo", layers=args.layers, embd=args.embd, heads=8, kv_heads=8, context=2048)
    data = demo.weights.read_bytes()
    server = EmbeddedServer(tmp / "nats", port=0)
    server.start()
    node = load(ROOT / "examples" / "cpu.toml").nodes[0]
    try:
        with serving(Hub(repos={SOURCE: Repo(files={demo.weights.name: data})}, rate=args.rate_mib * (1 << 20))) as hub:
            bus = await Bus.connect(Settings(nats_url=server.url), "llmgw-bench-weights")
            await bus.ensure_streams()
            keeper = FileKeeper(node.name, FilesConfig(models_dir=tmp / "models", hf_cache=tmp / "hf", endpoint=hub.url,
                                                       cache_max_bytes=10 << 30))
            cmds = dict(default_commands(), **{"llama.cpp": [binary, "-t", "1"]})
            sup = EngineSupervisor(node.name, EngineConfig(cmds=cmds, cpu=True, host="127.0.0.1", health_timeout_s=120,
                                                           models_dir=keeper.config.models_dir, version_cache=None))
            sup.files_ready, sup.files_held = keeper.ready, keeper.holds
            agent = Agent(bus, SimNvml(node), node.name, fabric=node.fabric, simulated=True, services=(sup, keeper))
            spec = m.ModelSpec(name="demo", source=SOURCE, precision="q8_0", engine="llama.cpp",
                               gpu_class=node.gpu_class, context=512, file=demo.weights.name, gib_per_gpu=1.0)
            task = asyncio.create_task(agent.run())
            await agent.started.wait()
            await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec))
            n = 0
            for _ in range(args.rounds):
                for cached in (False, True):
                    if not cached:
                        shutil.rmtree(keeper.config.models_dir / "acme__demo-GGUF", ignore_errors=True)
                    n += 1
                    await wake(bus, sup, spec, node.name, node.gpu_uuid(0), f"demo-r{n}")
            agent.stop()
            await task
            history = ModelHistory()
            async for batch in bus.reader(subjects.STREAM_CONTROL, 1,
                                          stop_at=await bus.stream_last_seq(subjects.STREAM_CONTROL)).batches():
                for raw in batch:
                    history.note(raw.seq, m.CONTROL_DECODER.decode(raw.data))
            await bus.close()
    finally:
        server.stop()
    starts = history.cold_starts("demo")
    cached = [c.total_s for c in starts if c.fetching_at is None and c.total_s is not None]
    fetched = [c.total_s for c in starts if c.fetching_at is not None and c.total_s is not None]
    downloads = [d for c in starts if (d := c.download_s) is not None]

    def fmt(xs: list[float]) -> str:
        return f"p50 {percentile(xs, 50) or 0:6.2f}s  p95 {percentile(xs, 95) or 0:6.2f}s  ({len(xs)} wakes)"

    size = len(data) / (1 << 20)
    print(f"demo model GGUF {size:.1f} MiB from the stand-in hub at {args.rate_mib:g} MiB/s; real llama-server, "
          f"{args.rounds} rounds; the ledger's placed → healthy")
    print(f"files on the node:   {fmt(cached)}")
    print(f"fetched first:       {fmt(fetched)}")
    print(f"  of which download: {fmt(downloads)}  ({size / (percentile(downloads, 50) or 1):.1f} MiB/s at the median)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rate-mib", type=float, default=20.0)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=512)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-weights-") as tmp:
        asyncio.run(main_async(args, Path(tmp)))


if __name__ == "__main__":
    main()
