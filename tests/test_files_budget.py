"""The disk budget: eviction takes only what no placed or pinned model needs, least recently used first.

A real file keeper over a real models directory, fetching from the stand-in hub (``hubserver``):
1,000 random place/stop/prefetch/pin cycles under a small budget, and the figures of a full disk.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hubserver import Hub, Repo, serving

from llmgw import messages as m
from llmgw.agent.downloads import DiskFullError, FileKeeper, FilesConfig, Held, plan_evictions
from llmgw.fleet.state import apply

T0 = datetime(2026, 1, 1, tzinfo=UTC)
NODE = "n1"
BUDGET = 150_000


def spec(i: int) -> m.ModelSpec:
    return m.ModelSpec(name=f"m{i}", source=f"acme/m{i}-GGUF", precision="q4_K_M", engine="llama.cpp",
                       gpu_class="L4-16GB", context=2048, file=f"m{i}.gguf", gib_per_gpu=1.0)


@pytest.fixture
def hub() -> Iterator[Hub]:
    rng = random.Random(7)
    repos = {spec(i).source: Repo(files={f"m{i}.gguf": os.urandom(rng.randrange(20_000, 60_000))}) for i in range(8)}
    repos[spec(9).source] = Repo(files={"m9.gguf": os.urandom(BUDGET + 1)})  # never fits
    with serving(Hub(repos=repos)) as h:
        yield h


def keeper(tmp_path: Path, hub: Hub) -> FileKeeper:
    k = FileKeeper(NODE, FilesConfig(models_dir=tmp_path / "models", hf_cache=tmp_path / "hf",
                                     cache_max_bytes=BUDGET, endpoint=hub.url))
    for i in (*range(8), 9):
        apply(k.checkpoint.state, m.ModelDeclared(at=T0, spec=spec(i)))
    return k


def on_disk(tmp_path: Path) -> dict[str, int]:
    """Source → bytes of its GGUF in the models directory."""
    out = {}
    for f in (tmp_path / "models").glob("*/*.gguf"):
        out[f.parent.name.replace("__", "/")] = f.stat().st_size
    return out


def test_the_eviction_plan_is_least_recently_used_and_never_needed() -> None:
    held = [Held("a", "models-dir", 40, T0), Held("b", "models-dir", 40, T0 + timedelta(hours=1)),
            Held("c", "hf-cache", 40, T0 - timedelta(hours=1)), Held("d", "models-dir", 40, None)]
    assert plan_evictions(held, set(), 200, 40) == []
    assert [h.source for h in plan_evictions(held, set(), 160, 40)] == ["d"]  # never used: first
    assert [h.source for h in plan_evictions(held, {"d"}, 160, 80)] == ["c", "a"]
    with pytest.raises(DiskFullError, match=r"held by models that are placed here or pinned \(a, b, c, d\)"):
        plan_evictions(held, {"a", "b", "c", "d"}, 160, 1)


async def test_a_thousand_random_cycles_never_evict_a_placed_or_pinned_models_files(
        hub: Hub, tmp_path: Path) -> None:
    k = keeper(tmp_path, hub)
    rng = random.Random(42)
    placed: dict[str, int] = {}  # replica → model index
    counts = {"place": 0, "stop": 0, "prefetch": 0, "pin": 0, "evicted": 0, "full": 0}
    for cycle in range(1000):
        before = on_disk(tmp_path)
        protected = {spec(i).source for i in placed.values()} | {
            spec(int(n[1:])).source for n in k.checkpoint.state.pinned}
        op = rng.choices(["place", "stop", "prefetch", "pin"], weights=[4, 3, 3, 1])[0]
        counts[op] += 1
        why = None
        wanted: m.ModelSpec | None = None
        if op == "place":
            i = rng.choice([*range(8), 9] if cycle % 50 == 0 else range(8))
            rid = f"m{i}-r{cycle}"
            wanted = spec(i)
            k._note(cycle, m.ReplicaPlaced(at=T0, replica_id=rid, model=wanted.name, nodes=(NODE,), gpus=(), spec=wanted), None)
            placed[rid] = i
            why = await k.ready(wanted)
            if why is not None:  # as the supervisor reports it failed, and the scheduler stops it
                k._note(cycle, m.ReplicaStopped(at=T0, replica_id=rid, model=wanted.name, reason="failed"), None)
                del placed[rid]
        elif op == "stop" and placed:
            rid = rng.choice(sorted(placed))
            k._note(cycle, m.ReplicaStopped(at=T0, replica_id=rid, model=f"m{placed.pop(rid)}", reason="idle"), None)
        elif op == "prefetch":
            wanted = spec(rng.randrange(8))
            why = await k.ready(wanted, use=False)
        elif op == "pin":
            name = f"m{rng.randrange(8)}"
            apply(k.checkpoint.state, m.ModelPinned(at=T0, name=name, pinned=name not in k.checkpoint.state.pinned))
        after = on_disk(tmp_path)
        gone = set(before) - set(after)
        counts["evicted"] += len(gone)
        assert not gone & protected, f"cycle {cycle}: evicted {gone & protected}, which a placed or pinned model needs"
        assert sum(after.values()) <= BUDGET, f"cycle {cycle}: {sum(after.values())} bytes over a {BUDGET} budget"
        if why is not None:
            counts["full"] += 1
            assert "(disk-full)" in why, why
            assert wanted is not None
            size = len(hub.repos[wanted.source].files[wanted.file or ""])
            kept = sum(before[s] for s in protected if s in before)
            assert kept + size > BUDGET, f"cycle {cycle}: refused although {kept} + {size} fits in {BUDGET}"
            assert wanted.source not in after  # nothing half-written was left
        elif wanted is not None:
            assert wanted.source in after, f"cycle {cycle}: {wanted.source} is not on disk after a fetch"
    assert all(counts[c] > 30 for c in ("place", "stop", "prefetch", "evicted")) and counts["full"] >= 5, counts


async def test_a_full_disk_is_refused_with_the_figures_before_a_byte_is_written(hub: Hub, tmp_path: Path) -> None:
    k = keeper(tmp_path, hub)
    assert await k.ready(spec(0)) is None
    apply(k.checkpoint.state, m.ModelPinned(at=T0, name="m0"))
    why = await k.ready(spec(9))
    held = len(hub.repos[spec(0).source].files["m0.gguf"]) / 1024
    assert why == ("files of acme/m9-GGUF not fetched (disk-full): 146.5 KiB to download does not fit: the budget is "
                   f"146.5 KiB and {held:.1f} KiB of it is held by models that are placed here or pinned (acme/m0-GGUF); "
                   "raise agent --cache-max-gib, unpin a model (ctl model unpin) or stop a replica on this node")
    assert set(on_disk(tmp_path)) == {"acme/m0-GGUF"}
    assert not list((tmp_path / "models").glob("acme__m9-GGUF"))


async def test_every_injected_digest_mismatch_is_caught_and_fetched_again(hub: Hub, tmp_path: Path) -> None:
    rng = random.Random(3)
    k = FileKeeper(NODE, FilesConfig(models_dir=tmp_path / "models", hf_cache=tmp_path / "hf",
                                     cache_max_bytes=1 << 30, endpoint=hub.url, attempts=4))
    injected = caught = 0
    for round_ in range(5):
        for i in range(8):
            shutil.rmtree(tmp_path / "models", ignore_errors=True)
            k.held = []
            bad = rng.randrange(0, 4)  # up to attempts - 1: each must be caught, and the last copy served
            hub.corrupt, before = bad, len(hub.served)
            assert await k.ready(spec(i)) is None, (round_, i)
            injected += bad
            caught += len(hub.served) - before - 1
            path = tmp_path / "models" / f"acme__m{i}-GGUF" / f"m{i}.gguf"
            assert path.read_bytes() == hub.repos[spec(i).source].files[f"m{i}.gguf"]
    assert injected >= 40 and caught == injected, (injected, caught)
