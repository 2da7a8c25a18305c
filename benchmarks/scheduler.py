"""How long the scheduler's pure decision takes on a large fleet, and the fold it decides on.

    python benchmarks/scheduler.py [--nodes 500] [--models 300] [--rounds 5]

Nodes of 8 GPUs in fabrics of 32; models of tp 1/2/4/8 (one in ten pp 2)
with 1-3 replicas each. Prints medians over the rounds for: the first pass
(places everything), a steady pass (nothing to do), and a pass after one node
is lost (re-places its replicas).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime

from llmgw import messages as m
from llmgw.fleet.state import FleetState, apply
from llmgw.fleetfile import FleetNode, inventory
from llmgw.scheduler import placement as s

T0 = datetime(2026, 11, 1, tzinfo=UTC)


def world(nodes: int, models: int) -> tuple[FleetState, s.SchedulerMemory]:
    state, memory = FleetState(), s.SchedulerMemory()
    for i in range(nodes):
        n = FleetNode(name=f"n{i:04d}", fabric=f"ib-{i // 32}", gpu_class="H100-80GB", gpu_count=8, gpu_memory_mib=81559)
        apply(state, inventory(n, T0))
    for j in range(models):
        spec = m.ModelSpec(name=f"m{j:04d}", source="org/m", precision="bf16", engine="vllm", gpu_class="H100-80GB",
                           context=8192, tp=(1, 2, 4, 8)[j % 4], pp=2 if j % 10 == 0 else 1, replicas=1 + j % 3)
        ev = m.ModelDeclared(at=T0, spec=spec)
        s.observe(memory, ev, state)
        apply(state, ev)
    return state, memory


def fold_in(state: FleetState, memory: s.SchedulerMemory, decisions: list[s.Decision]) -> None:
    for d in decisions:
        s.observe(memory, d.event, state)
        apply(state, d.event)


def timed(fn: Callable[[], list[s.Decision]]) -> tuple[float, int]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, len(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument("--models", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    first, steady, lost = [], [], []
    counts = (0, 0, 0)
    for _ in range(args.rounds):
        state, memory = world(args.nodes, args.models)
        t1, n1 = timed(lambda: s.decide(state, memory, T0))  # noqa: B023 - called at once
        fold_in(state, memory, s.decide(state, memory, T0))
        t2, n2 = timed(lambda: s.decide(state, memory, T0))  # noqa: B023
        victim = next(iter(state.replicas.values())).nodes[0]
        apply(state, m.NodeLost(at=T0, node=victim))
        t3, n3 = timed(lambda: s.decide(state, memory, T0))  # noqa: B023
        first.append(t1)
        steady.append(t2)
        lost.append(t3)
        counts = (n1, n2, n3)
    gpus = args.nodes * 8
    print(f"fleet: {args.nodes} nodes / {gpus} GPUs, {args.models} models; medians of {args.rounds} rounds")
    print(f"first pass (places everything): {statistics.median(first) * 1e3:8.1f} ms  ({counts[0]} decisions)")
    print(f"steady pass (nothing to do):    {statistics.median(steady) * 1e3:8.1f} ms  ({counts[1]} decisions)")
    print(f"after one NodeLost:             {statistics.median(lost) * 1e3:8.1f} ms  ({counts[2]} decisions)")


if __name__ == "__main__":
    main()
