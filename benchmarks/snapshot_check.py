"""What checking a fold snapshot against the control stream costs a reader that starts from it.

Every placement and endpoint a snapshot asserts is fetched from the control stream (one
direct get per message, ``snapshots.CHECKS_AT_ONCE`` in flight) and compared. This places
``--replicas`` one-GPU replicas on a simulated fleet, each reported healthy with an
endpoint, folds the history, then times the check (median of ``--rounds``) next to decoding
the snapshot's blob, the step it is added to.

    .venv/bin/python benchmarks/snapshot_check.py --replicas 2000

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.bus.server import EmbeddedServer
from llmgw.config import Settings
from llmgw.fleet import snapshots
from llmgw.fleet.fold import decode_state, encode
from llmgw.fleet.replay import replay

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def spec(name: str) -> m.ModelSpec:
    return m.ModelSpec(name=name, source=f"org/{name}", precision="bf16", engine="vllm", gpu_class="H100-80GB",
                       context=8192)


async def main(replicas: int, rounds: int) -> None:
    store = Path(tempfile.mkdtemp(prefix="llmgw-bench-check-"))
    server = EmbeddedServer(store, port=0).start()
    bus = await Bus.connect(Settings(nats_url=server.url), "bench-snapshot-check")
    try:
        await bus.ensure_streams()
        nodes = (replicas + 7) // 8
        for n in range(nodes):
            gpus = tuple(m.GpuInfo(index=i, uuid=f"GPU-{n}-{i}", name="NVIDIA H100 80GB", gpu_class="H100-80GB",
                                   memory_mib=81559) for i in range(8))
            await bus.publish(m.NodeInventoryReported(at=T0, node=f"n{n}", fabric="ib-a", fabric_source="flag",
                                                     boot_id="b", gpus=gpus))
        await bus.publish(m.ModelDeclared(at=T0, spec=spec("model")))
        for r in range(replicas):
            node, gpu, at = f"n{r // 8}", r % 8, T0 + timedelta(seconds=1)
            rid = f"model-r{r}"
            await bus.publish(m.ReplicaPlaced(at=at, replica_id=rid, model="model", nodes=(node,), spec=spec("model"),
                                              gpus=(m.GpuRef(node=node, index=gpu, uuid=f"GPU-{r // 8}-{gpu}"),)))
            await bus.publish(m.ReplicaStateChanged(at=at, replica_id=rid, model="model", node=node, state="healthy",
                                                    endpoint=f"http://{node}:{8000 + gpu}"))
        c = await replay(bus, use_snapshots=False)
        blob = encode(c)
        last = await bus.stream_last_seq(subjects.STREAM_CONTROL)
        checks, decodes = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            decoded = decode_state(blob)
            decodes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            why = await snapshots.unfounded(bus, decoded, last)
            checks.append(time.perf_counter() - t0)
            assert why == "", why
        claims = len(snapshots.claims(c))
        print(f"snapshot check: {replicas:,} replicas healthy ({claims:,} claims: placements and endpoints, "
              f"in the fold and the routers' pool; {last:,} control messages), median of {rounds}")
        print(f"  decode the snapshot ({len(blob) / 1024:,.0f} KiB)   {statistics.median(decodes) * 1e3:8.1f} ms")
        print(f"  check it against the control stream        {statistics.median(checks) * 1e3:8.1f} ms "
              f"({statistics.median(checks) / max(1, last) * 1e6:.0f} µs per control message)")
    finally:
        await bus.close()
        server.stop()
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    asyncio.run(main(args.replicas, args.rounds))
