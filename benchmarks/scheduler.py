"""How long the scheduler's pure decision takes on a large fleet, and the fold it decides on.

    python benchmarks/scheduler.py [--nodes 500] [--models 300] [--small 5000] [--rounds 5]

Nodes of 8 H100-80GB GPUs in fabrics of 32. Two fleets of models, each pass timed
alone and the medians over the rounds printed:

* vLLM models of tp 1/2/4/8 (one in ten pp 2) with 1-3 replicas each: the first
  pass (places everything), a steady pass (nothing to do), and a pass after one
  node is lost (re-places its replicas).
* ``--small`` small llama.cpp replicas (five a model, ``gib_per_gpu`` of 1.5 to
  9 GiB), placed by packing (several share a card) and, the same specs declared
  ``exclusive``, on whole GPUs, side by side with the ratio. Whole GPUs hold at
  most one replica a GPU, so like is compared with like: the first pass with as
  many replicas declared as there are GPUs (both place them all), the first pass
  with all ``--small`` declared (packing places them all; whole GPUs place one a
  GPU and explain the rest), the steady pass of each, and a NodeLost. The
  issue's goal: a packing pass takes at most 1.5x the whole-GPU one.

Run against a tree from before GPUs were shared (no ``ModelSpec.exclusive``), it
times the whole-GPU column only, which is then that tree's one placement.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime

from llmgw import messages as m
from llmgw.fleet.demand import SchedulerMemory, observe
from llmgw.fleet.state import FleetState, apply
from llmgw.fleetfile import FleetNode, inventory
from llmgw.scheduler import placement as s

T0 = datetime(2026, 11, 1, tzinfo=UTC)
CARD_MIB = 81559
GPUS_PER_NODE = 8
SMALL_GIB = (1.5, 3.0, 4.5, 6.0, 9.0)  # what a small llama.cpp replica books on a card, by model
SMALL_PER_MODEL = 5
SHARING = "exclusive" in m.ModelSpec.__struct_fields__  # False on a tree from before GPUs were shared


def fleet(nodes: int) -> tuple[FleetState, SchedulerMemory]:
    state, memory = FleetState(), SchedulerMemory()
    for i in range(nodes):
        n = FleetNode(name=f"n{i:04d}", fabric=f"ib-{i // 32}", gpu_class="H100-80GB", gpu_count=GPUS_PER_NODE,
                      gpu_memory_mib=CARD_MIB)
        apply(state, inventory(n, T0))
    return state, memory


def declare(state: FleetState, memory: SchedulerMemory, specs: list[m.ModelSpec]) -> None:
    for spec in specs:
        ev = m.ModelDeclared(at=T0, spec=spec)
        observe(memory, ev, state)
        apply(state, ev)


def world(nodes: int, models: int) -> tuple[FleetState, SchedulerMemory]:
    state, memory = fleet(nodes)
    declare(state, memory, [
        m.ModelSpec(name=f"m{j:04d}", source="org/m", precision="bf16", engine="vllm", gpu_class="H100-80GB",
                    context=8192, tp=(1, 2, 4, 8)[j % 4], pp=2 if j % 10 == 0 else 1, replicas=1 + j % 3)
        for j in range(models)])
    return state, memory


def small_world(nodes: int, replicas: int, exclusive: bool) -> tuple[FleetState, SchedulerMemory]:
    """``replicas`` small llama.cpp replicas (five a model, the last model fewer), shared or on whole GPUs."""
    state, memory = fleet(nodes)
    extra = {"exclusive": True} if exclusive and SHARING else {}
    specs = []
    for j, first in enumerate(range(0, replicas, SMALL_PER_MODEL)):
        specs.append(m.ModelSpec(
            name=f"s{j:04d}", source="org/s-GGUF", precision="q4_k_m", engine="llama.cpp", gpu_class="H100-80GB",
            context=4096, file="s.gguf", replicas=min(SMALL_PER_MODEL, replicas - first),
            gib_per_gpu=SMALL_GIB[j % len(SMALL_GIB)], **extra))
    declare(state, memory, specs)
    return state, memory


def fold_in(state: FleetState, memory: SchedulerMemory, decisions: list[s.Decision]) -> None:
    for d in decisions:
        observe(memory, d.event, state)
        apply(state, d.event)


def timed(fn: Callable[[], list[s.Decision]]) -> tuple[float, list[s.Decision]]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def placed(decisions: list[s.Decision]) -> int:
    return sum(1 for d in decisions if isinstance(d.event, m.ReplicaPlaced))


def passes(state: FleetState, memory: SchedulerMemory) -> dict[str, tuple[float, list[s.Decision]]]:
    """First pass, steady pass, and the pass after the first replica's node is lost, on one world."""
    out = {"first": timed(lambda: s.decide(state, memory, T0))}
    fold_in(state, memory, out["first"][1])
    out["steady"] = timed(lambda: s.decide(state, memory, T0))
    victim = next(iter(state.replicas.values())).nodes[0]
    apply(state, m.NodeLost(at=T0, node=victim))
    out["lost"] = timed(lambda: s.decide(state, memory, T0))
    return out


def gpus_held(state: FleetState) -> int:
    return len({(g.node, g.index) for r in state.replicas.values() for g in r.gpus})


def vllm_fleet(args: argparse.Namespace) -> None:
    rounds = []
    for _ in range(args.rounds):
        rounds.append(passes(*world(args.nodes, args.models)))
    gpus = args.nodes * GPUS_PER_NODE
    print(f"fleet: {args.nodes} nodes / {gpus} GPUs, {args.models} vLLM models of tp 1/2/4/8; "
          f"medians of {args.rounds} rounds")
    for key, label in (("first", "first pass (places everything):"), ("steady", "steady pass (nothing to do):   "),
                       ("lost", "after one NodeLost:            ")):
        ms = statistics.median(r[key][0] for r in rounds) * 1e3
        print(f"{label} {ms:8.1f} ms  ({len(rounds[-1][key][1])} decisions)")


def small_fleet(args: argparse.Namespace) -> None:
    gpus = args.nodes * GPUS_PER_NODE
    like = min(args.small, gpus)  # whole GPUs place at most one replica a GPU
    counts = sorted({like, args.small})
    cases = [(n, True) for n in counts] + ([(n, False) for n in counts] if SHARING else [])
    runs: dict[tuple[int, bool], list[dict[str, tuple[float, list[s.Decision]]]]] = {c: [] for c in cases}
    held: dict[tuple[int, bool], int] = {}
    for _ in range(args.rounds):
        for n, exclusive in cases:
            state, memory = small_world(args.nodes, n, exclusive)
            runs[n, exclusive].append(passes(state, memory))
            held[n, exclusive] = gpus_held(state)

    def cell(n: int, exclusive: bool, key: str) -> tuple[float, str]:
        if (n, exclusive) not in runs:
            return 0.0, ""
        ms = statistics.median(r[key][0] for r in runs[n, exclusive]) * 1e3
        ds = runs[n, exclusive][-1][key][1]
        short = sum(1 for d in ds if isinstance(d.event, m.ModelUnplaceable))
        what = f"{placed(ds)} placed" + (f", {short} unplaceable" if short else "")
        if key == "steady":
            what = f"{len(ds)} decisions"
        return ms, f"{ms:8.1f} ms ({what})"

    sizes = "/".join(f"{g:g}" for g in SMALL_GIB)
    print(f"\nsmall llama.cpp replicas on the same fleet ({sizes} GiB a replica, {SMALL_PER_MODEL} a model, "
          f"{CARD_MIB} MiB cards); medians of {args.rounds} rounds")
    print(f"{'pass':<34} {'packing':<36} {'whole GPUs (exclusive)':<44} packing / whole")
    names = {"first": "first pass", "steady": "steady pass", "lost": "after one NodeLost"}
    rows = [(f"{names[key]}, {n:,} declared", n, key) for key in names for n in counts]
    ratios = {}
    for label, n, key in rows:
        p_ms, p = cell(n, False, key)
        w_ms, w = cell(n, True, key)
        ratio = f"{p_ms / w_ms:5.2f}x" if p and w_ms else ""
        ratios[label] = p_ms / w_ms if p and w_ms else 0.0
        print(f"{label:<34} {p:<36} {w:<44} {ratio}")
    held_line = ", ".join(f"{'whole GPUs' if ex else 'packing'} {held[n, ex]:,} ({n:,} declared)"
                          for n, ex in cases)
    print(f"GPUs held after the first pass: {held_line}, of {gpus:,}")
    if SHARING:
        first = ratios[f"first pass, {like:,} declared"]
        verdict = "met" if first <= 1.5 else "NOT met"
        print(f"goal: a packing first pass at most 1.5x the whole-GPU one ({like:,} placed in both): "
              f"{first:.2f}x, {verdict}")
    else:
        print("this tree has no ModelSpec.exclusive (from before GPUs were shared): whole GPUs only")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument("--models", type=int, default=300)
    ap.add_argument("--small", type=int, default=5000, help="small llama.cpp replicas (0: skip that fleet)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.nodes < 1 or args.models < 0 or args.small < 0 or args.rounds < 1:
        ap.error("--nodes and --rounds are at least 1, --models and --small at least 0")
    if args.models:
        vllm_fleet(args)
    if args.small:
        small_fleet(args)


if __name__ == "__main__":
    main()
