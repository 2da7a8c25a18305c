"""What preferring the nodes that hold a model's files costs the scheduler's pass, and what it buys.

    python benchmarks/files.py [--nodes 500] [--small 5000] [--holders 4] [--rounds 3]

The small llama.cpp fleet of benchmarks/scheduler.py (8 × H100-80GB a node, five replicas a
model), each model with its own GGUF repository. Timed twice on the same declarations: with
no node reporting its disk (placement as before), and with every node reporting a
``NodeFilesReported`` in which ``--holders`` nodes per model hold its file. Printed: the
first pass and the pass after one NodeLost (medians), and the share of the replicas placed on
a node holding their files (by chance alone, with no reports, it is holders / nodes).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from scheduler import SMALL_GIB, SMALL_PER_MODEL, T0, declare, fleet, fold_in, timed  # noqa: E402

from llmgw import messages as m  # noqa: E402
from llmgw.fleet.files import by_source, holders_of  # noqa: E402
from llmgw.fleet.state import FleetState, apply  # noqa: E402
from llmgw.scheduler import placement as s  # noqa: E402


def specs(replicas: int) -> list[m.ModelSpec]:
    return [m.ModelSpec(name=f"s{j:04d}", source=f"org/s{j:04d}-GGUF", precision="q4_k_m", engine="llama.cpp",
                        gpu_class="H100-80GB", context=4096, file="s.gguf",
                        replicas=min(SMALL_PER_MODEL, replicas - first), gib_per_gpu=SMALL_GIB[j % len(SMALL_GIB)])
            for j, first in enumerate(range(0, replicas, SMALL_PER_MODEL))]


def reports(state: FleetState, models: list[m.ModelSpec], per_model: int, rng: random.Random) -> None:
    nodes = sorted(state.nodes)
    held: dict[str, list[m.HeldSource]] = {n: [] for n in nodes}
    for spec in models:
        for n in rng.sample(nodes, per_model):
            held[n].append(m.HeldSource(source=spec.source, store="models-dir", size=5 << 30,
                                        files=(m.HeldFile(path="s.gguf", size=5 << 30),)))
    for n, sources in held.items():
        apply(state, m.NodeFilesReported(at=T0, node=n, sources=tuple(sources[:m.MAX_HELD_SOURCES])))


def on_holders(state: FleetState, decisions: list[s.Decision]) -> float:
    placed = [d.event for d in decisions if isinstance(d.event, m.ReplicaPlaced)]
    index = by_source(state.files)
    hit = sum(1 for e in placed if e.nodes[0] in holders_of(index, e.spec))
    return hit / len(placed) if placed else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument("--small", type=int, default=5000)
    ap.add_argument("--holders", type=int, default=4, help="nodes holding each model's file")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    models = specs(args.small)
    results: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    for r in range(args.rounds):
        for with_files in (False, True):
            state, memory = fleet(args.nodes)
            if with_files:
                reports(state, models, args.holders, random.Random(r))
            declare(state, memory, models)
            first_s, first = timed(lambda state=state, memory=memory: s.decide(state, memory, T0))
            share = on_holders(state, first) if with_files else 0.0
            fold_in(state, memory, first)
            victim = next(iter(state.replicas.values())).nodes[0]
            apply(state, m.NodeLost(at=T0, node=victim))
            lost_s, _ = timed(lambda state=state, memory=memory: s.decide(state, memory, T0))
            results[with_files].append((first_s, lost_s, share))
    print(f"fleet: {args.nodes} nodes / {args.nodes * 8} GPUs, {args.small:,} small llama.cpp replicas in "
          f"{len(models)} models, {args.holders} nodes holding each model's file; medians of {args.rounds} rounds")
    for label, i in (("first pass (places everything)", 0), ("after one NodeLost", 1)):
        a = statistics.median(x[i] for x in results[False]) * 1e3
        b = statistics.median(x[i] for x in results[True]) * 1e3
        print(f"{label:<32} no file reports {a:8.1f} ms   with file reports {b:8.1f} ms   {b / a:5.2f}x")
    share = statistics.median(x[2] for x in results[True])
    print(f"replicas placed on a node holding their file: {share:.1%} "
          f"(by chance alone: {args.holders / args.nodes:.1%} a replica)")


if __name__ == "__main__":
    main()
