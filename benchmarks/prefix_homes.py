"""What a new prefix home costs the router's event loop: before (every home placed again) and after.

    python benchmarks/prefix_homes.py [--homes 256,1024] [--replicas 8,64,256]

Before (issue 45): each new homed key recomputed every home (``homes`` over all keys, each
walking the whole ring: O(homes x replicas)). After: ``prefix.Homes.add`` puts the new key
in place (deferred acceptance; the full re-placement only when the stepped cap changes).
For each replica count, N keys are homed one after another; the figures are the cost of
the N-th home (mean over the last 32 added) and the mean and worst over all N and over N more
at the bound (each evicting the oldest), in ms. The
old rule is copied here as it was, so the two are measured side by side.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from bisect import bisect_left
from collections.abc import Sequence

from llmgw.router import prefix as pr


def old_walk(ring: pr.Ring, key: int) -> list[str]:
    out: list[str] = []
    n = len(ring.hashes)
    i = bisect_left(ring.hashes, key)
    seen: set[str] = set()
    for j in range(n):
        rid = ring.owners[(i + j) % n]
        if rid not in seen:
            seen.add(rid)
            out.append(rid)
            if len(out) == ring.size:
                break
    return out


def old_homes(keys: Sequence[int], ring: pr.Ring) -> dict[int, str]:
    """The rule as each new home ran it before: every key placed again, each walking the whole ring."""
    cap = max(1, math.ceil(pr.PREFIX_FACTOR * len(keys) / ring.size))
    count: dict[str, int] = {}
    out: dict[int, str] = {}
    for key in sorted(keys):
        for rid in old_walk(ring, key):
            if count.get(rid, 0) < cap:
                out[key] = rid
                count[rid] = count.get(rid, 0) + 1
                break
    return out


def run(replicas: int, n: int, before: bool) -> tuple[float, float, float]:
    rng = random.Random(replicas * 7919 + n)
    ring = pr.Ring([f"replica-{i}" for i in range(replicas)])
    keys = [rng.getrandbits(64) for _ in range(n)]
    costs: list[float] = []
    if before:
        # The old cost is the same for every key at a given count: sample it, not n² of it.
        for size in sorted({max(1, n * k // 16) for k in range(1, 17)}):
            t0 = time.perf_counter()
            old_homes(keys[:size], ring)
            costs.append(time.perf_counter() - t0)
        last = costs[-1]
    else:
        homes = pr.Homes(ring)
        for k in keys:
            t0 = time.perf_counter()
            homes.add(k)
            costs.append(time.perf_counter() - t0)
        last = statistics.fmean(costs[-32:])
        # At the table's bound each new home evicts the oldest (ghosts, re-placed past half).
        steady: list[float] = []
        for i in range(n):
            new = rng.getrandbits(64)
            t0 = time.perf_counter()
            homes.remove(keys[i])
            homes.add(new)
            steady.append(time.perf_counter() - t0)
        costs = steady + costs
    return last * 1000, statistics.fmean(costs) * 1000, max(costs) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--homes", default="256,1024")
    ap.add_argument("--replicas", default="8,64,256")
    args = ap.parse_args()
    print("| replicas | homes | before: the N-th home, ms | after: the N-th home (mean of last 32), ms "
          "| after: mean / worst over all N and N more at the bound, ms |")
    print("|---:|---:|---:|---:|---:|")
    for r in (int(x) for x in args.replicas.split(",")):
        for n in (int(x) for x in args.homes.split(",")):
            b_last, _, _ = run(r, n, before=True)
            a_last, a_mean, a_max = run(r, n, before=False)
            print(f"| {r} | {n:,} | {b_last:.2f} | {a_last:.4f} | {a_mean:.4f} / {a_max:.2f} |", flush=True)


if __name__ == "__main__":
    main()
