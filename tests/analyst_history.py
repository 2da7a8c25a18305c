"""Three simulated days of a small fleet, projected into DuckDB: the history docs/data.md's examples run on.

Deterministic, so the outputs printed in the doc are what its queries give
(tests/test_analyst_sql.py checks that with the DuckDB CLI). Traffic follows
office hours, a GPU fault forces a re-placement, a scaled-to-zero model is woken
by a request, a router restarts, a node is lost and returns; two models share an
L40S card, and one of them grows past what it booked there.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

from llmgw import messages as m
from llmgw import subjects
from llmgw.agent.nvml import ecc_finding, xid_finding
from llmgw.fleet.fold import encode_state
from llmgw.fleet.state import Cursor, FleetState, apply
from llmgw.projections.store import Batch, Store, add_event_rows

T0 = datetime(2026, 3, 2, 8, 0, tzinfo=UTC)  # a Monday morning
DAYS = 3
TICK = timedelta(minutes=2)
ROUTERS = ("router-a", "router-b")
THERMAL = "thermal slowdown"


def at(day: int, hh: int, mm: int = 0) -> datetime:
    """Day 0 is 2026-03-02."""
    return T0.replace(hour=0) + timedelta(days=day, hours=hh, minutes=mm)


def _node(name: str, fabric: str, gpu_class: str, count: int, t: datetime,
          bad: dict[int, str] | None = None) -> m.NodeInventoryReported:
    bad = bad or {}
    return m.NodeInventoryReported(
        at=t, node=name, fabric=fabric, fabric_source="fleet-file", boot_id=f"{name}-boot", simulated=True,
        gpus=tuple(m.GpuInfo(index=i, uuid=f"GPU-{name}-{i}", name=f"NVIDIA {gpu_class}", gpu_class=gpu_class,
                             memory_mib=81559 if gpu_class.startswith("H100") else 46068, healthy=i not in bad,
                             reasons=(bad[i],) if i in bad else ()) for i in range(count)))


def _spec(name: str, gpu_class: str, tp: int = 1, pp: int = 1, replicas: int = 1, kv: int = 0,
          autoscale: bool = False, gib: float = 0.0) -> m.ModelSpec:
    """A vLLM model; with ``gib``, a llama.cpp one whose plan charges that much per GPU (it shares a card)."""
    return m.ModelSpec(name=name, source=f"org/{name}", precision="q8_0" if gib else "bf16",
                       engine="llama.cpp" if gib else "vllm", gpu_class=gpu_class,
                       context=32768, tp=tp, pp=pp, replicas=replicas, kv_tokens=kv,
                       gib_per_gpu=gib or (72.0 if gpu_class.startswith("H100") else 36.0),
                       min_replicas=0 if autoscale else None, max_replicas=2 if autoscale else None)


LLAMA = _spec("llama-3.3-70b", "H100-80GB", tp=4, replicas=2, kv=180_000)
QWEN = _spec("qwen2.5-7b", "L40S-48GB", replicas=2, kv=90_000)
CODER = _spec("coder-32b", "H100-80GB", tp=2, kv=120_000, autoscale=True)
EMBED = _spec("embed-small", "L40S-48GB", gib=4.0)
DEEPSEEK = _spec("deepseek-v3", "H100-80GB", tp=8, pp=4)
XID79 = xid_finding(79).text
# What the L40S replicas book: qwen a share of its card (the H100 ones, placed the old way, the whole card),
# and embed-small beside it on the same one.
QWEN_MIB, EMBED_MIB = 36 * 1024, 4 * 1024


def _placed(rid: str, s: m.ModelSpec, node: str, gpus: range, t: datetime, fabric: str, why: str,
            mib: int = 0) -> m.ReplicaPlaced:
    return m.ReplicaPlaced(at=t, replica_id=rid, model=s.name, nodes=(node,), fabric=fabric, spec=s, reason=why,
                           gpus=tuple(m.GpuRef(node=node, index=i, uuid=f"GPU-{node}-{i}", mib=mib) for i in gpus))


def _healthy(rid: str, s: m.ModelSpec, node: str, t: datetime, kv: int) -> m.ReplicaStateChanged:
    # What NVML lists for the engine on this node: a little under the plan, as vLLM's own figures run.
    memory = round(s.gib_per_gpu * s.tp * 1024 * 0.97)
    return m.ReplicaStateChanged(at=t, replica_id=rid, model=s.name, node=node, state="healthy",
                                 endpoint=f"http://{node}:8000", observed_kv_tokens=kv, observed_memory_mib=memory)


def _health(node: str, gpu: int, t: datetime, healthy: bool, *reasons: str) -> m.GpuHealthChanged:
    return m.GpuHealthChanged(at=t, node=node, gpu_index=gpu, gpu_uuid=f"GPU-{node}-{gpu}", healthy=healthy,
                              reasons=reasons)


def _story() -> list[m.Event]:
    """Everything but the routers' idle maps."""
    start = T0
    xid48 = xid_finding(48).text
    out: list[m.Event] = [
        _node("h100-a-01", "ib-a", "H100-80GB", 8, start),
        _node("h100-a-02", "ib-a", "H100-80GB", 8, start),
        _node("h100-a-03", "ib-a", "H100-80GB", 8, start),
        _node("h100-a-04", "ib-a", "H100-80GB", 8, start),
        _node("h100-b-01", "ib-b", "H100-80GB", 8, start),
        _node("h100-b-02", "ib-b", "H100-80GB", 8, start, bad={5: XID79}),
        _node("l40s-01", "pcie", "L40S-48GB", 4, start),
        _node("l40s-02", "pcie", "L40S-48GB", 4, start),
        *(m.ModelDeclared(at=at(0, 8, 1), spec=s) for s in (LLAMA, QWEN, CODER, EMBED, DEEPSEEK)),
        _placed("llama-3.3-70b-r1", LLAMA, "h100-a-01", range(4), at(0, 8, 2), "ib-a", "0 of 2 running"),
        _placed("llama-3.3-70b-r2", LLAMA, "h100-a-02", range(4), at(0, 8, 2), "ib-a", "1 of 2 running"),
        _placed("qwen2.5-7b-r1", QWEN, "l40s-01", range(1), at(0, 8, 2), "pcie", "0 of 2 running", QWEN_MIB),
        _placed("qwen2.5-7b-r2", QWEN, "l40s-02", range(1), at(0, 8, 2), "pcie", "1 of 2 running", QWEN_MIB),
        _placed("coder-32b-r1", CODER, "h100-a-03", range(2), at(0, 8, 2), "ib-a", "0 of 1 running"),
        _placed("embed-small-r1", EMBED, "l40s-01", range(1), at(0, 8, 2), "pcie", "0 of 1 running", EMBED_MIB),
        m.ModelUnplaceable(at=at(0, 8, 2), name="deepseek-v3",
                           reason="needs 4 whole H100-80GB nodes on one fabric; ib-a has 1 free, ib-b 1"),
        _healthy("llama-3.3-70b-r1", LLAMA, "h100-a-01", at(0, 8, 6), 172_032),
        _healthy("llama-3.3-70b-r2", LLAMA, "h100-a-02", at(0, 8, 6), 172_032),
        _healthy("qwen2.5-7b-r1", QWEN, "l40s-01", at(0, 8, 4), 93_184),
        _healthy("qwen2.5-7b-r2", QWEN, "l40s-02", at(0, 8, 4), 93_184),
        _healthy("coder-32b-r1", CODER, "h100-a-03", at(0, 8, 5), 118_784),
        _healthy("embed-small-r1", EMBED, "l40s-01", at(0, 8, 3), 0),
        # nobody asks for coder: the autoscaler parks it
        m.ModelAutoscaled(at=at(0, 9, 0), name="coder-32b", replicas=1, reason="scaled down: no request for 55m"),
        m.ReplicaStopped(at=at(0, 9, 0), replica_id="coder-32b-r1", model="coder-32b", reason="scaled down to 0"),
        # an XID 48 under llama's second replica: unhealthy, re-placed on another node
        _health("h100-a-02", 1, at(0, 14, 0), False, xid48),
        m.ReplicaStopped(at=at(0, 14, 1), replica_id="llama-3.3-70b-r2", model=LLAMA.name,
                         reason=f"re-placing: GPU 1 (GPU-h100-a-02-1) on h100-a-02 unhealthy: {xid48}"),
        _placed("llama-3.3-70b-r3", LLAMA, "h100-a-04", range(4), at(0, 14, 1), "ib-a", "1 of 2 running"),
        _healthy("llama-3.3-70b-r3", LLAMA, "h100-a-04", at(0, 14, 5), 172_032),
        _health("h100-a-02", 1, at(0, 20, 0), True),  # reset
        _health("h100-a-01", 0, at(1, 3, 0), True, THERMAL),
        _health("h100-a-01", 0, at(1, 3, 40), True),
        # a request wakes coder
        m.ModelWanted(at=at(1, 9, 10), router="router-a", boot_id="router-a-0", model="coder-32b", control_seq=40,
                      waiting=3),
        m.ModelAutoscaled(at=at(1, 9, 10), name="coder-32b", replicas=1, reason="woken by router-a: 3 requests waiting"),
        _placed("coder-32b-r2", CODER, "h100-a-03", range(2), at(1, 9, 10), "ib-a",
                "woken by router-a: 3 requests waiting"),
        _healthy("coder-32b-r2", CODER, "h100-a-03", at(1, 9, 14), 118_784),
        _health("l40s-01", 0, at(1, 10, 30), True, xid_finding(13).text),
        # embed-small's engine grows past what it booked beside qwen: its agent says so
        m.ReplicaStateChanged(at=at(1, 11, 0), replica_id="embed-small-r1", model=EMBED.name, node="l40s-01",
                              state="healthy", endpoint="http://l40s-01:8000", observed_memory_mib=4700),
        m.ReplicaOverBooked(at=at(1, 11, 0), replica_id="embed-small-r1", model=EMBED.name, node="l40s-01",
                            booked_mib=EMBED_MIB, used_mib=4700, source="nvml"),
        m.ModelAutoscaled(at=at(1, 12, 40), name="coder-32b", replicas=0, reason="scaled down: no request for 40m"),
        m.ReplicaStopped(at=at(1, 12, 40), replica_id="coder-32b-r2", model="coder-32b", reason="scaled down to 0"),
        m.NodeLost(at=at(1, 22, 0), node="h100-b-02"),
        m.NodeReturned(at=at(2, 1, 0), node="h100-b-02", boot_id="h100-b-02-boot2"),
        _node("h100-b-02", "ib-b", "H100-80GB", 8, at(2, 1, 0), bad={5: XID79}),
        _health("h100-b-01", 3, at(2, 5, 0), False, ecc_finding(2).text),
    ]
    return out


def _asked(model: str, router: str, t: datetime) -> bool:
    """Whether a router sent the model a request in the tick that ends at ``t``."""
    h = t.hour + t.minute / 60
    match model:
        case "llama-3.3-70b":
            return 8 <= h < 19
        case "qwen2.5-7b":
            return router == "router-a" and 7 <= h < 22 or (router == "router-b" and t.minute == 0 and h >= 8)
        case "coder-32b":
            return router == "router-a" and t.date() == at(1, 0).date() and 9.25 <= h < 12
    return False  # embed-small: nobody


def _idle_maps(story: list[m.Event]) -> Iterator[m.Event]:
    """Each router's map every tick: who got a request, who is routed to without one."""
    healthy: dict[str, tuple[str, datetime]] = {}  # replica -> (model, healthy since)
    changes = sorted((e for e in story if isinstance(e, m.ReplicaStateChanged | m.ReplicaStopped)),
                     key=lambda e: e.at)
    boot = {r: (f"{r}-0", T0) for r in ROUTERS}
    ticks = dict.fromkeys(ROUTERS, 0)
    last: dict[str, dict[str, datetime]] = {r: {} for r in ROUTERS}
    since: dict[str, dict[str, datetime]] = {r: {} for r in ROUTERS}
    t, i = T0 + TICK, 0
    while t <= T0 + timedelta(days=DAYS):
        while i < len(changes) and changes[i].at <= t:
            e = changes[i]
            if isinstance(e, m.ReplicaStateChanged):
                healthy[e.replica_id] = (e.model, e.at)
            else:
                healthy.pop(e.replica_id, None)
            i += 1
        for r in ROUTERS:
            if r == "router-b" and boot[r][0] == "router-b-0" and t >= at(1, 12, 0):
                boot[r], ticks[r], last[r], since[r] = ("router-b-1", t), 0, {}, {}  # restarted: knows nothing
            ticks[r] += 1
            booted = boot[r][1]
            for rid, (model, up) in healthy.items():
                if _asked(model, r, t):
                    last[r][rid] = t - timedelta(seconds=7)
                elif booted != t:
                    since[r].setdefault(rid, max(up, booted))
            yield m.IdleMapPublished(
                at=t, router=r, boot_id=boot[r][0], tick=ticks[r], tick_s=TICK.total_seconds(),
                last_request={rid: x for rid, x in last[r].items() if rid in healthy},
                serving_since={rid: x for rid, x in since[r].items() if rid in healthy and rid not in last[r]})
        t += TICK


def history() -> list[m.Event]:
    story = _story()
    return sorted([*story, *_idle_maps(story)], key=lambda e: e.at)  # stable: the story's order within a time


def project(path: Path, events: list[m.Event] | None = None, *, commit_every: int = 2000) -> Store:
    """Project ``events`` (default: ``history()``) into a DuckDB file as the projector does, stored when sent."""
    store = Store(path)
    state, cursor, batch = FleetState(), Cursor(), Batch()
    for e in history() if events is None else events:
        subject = subjects.subject_for(e)
        stream = subjects.stream_for_subject(subject)
        seq = cursor.positions[stream] = cursor.positions.get(stream, 0) + 1
        prev = state.routers.get(e.router) if isinstance(e, m.IdleMapPublished) else None
        stored_ns = int(e.at.timestamp()) * 1_000_000_000 + e.at.microsecond * 1000
        add_event_rows(batch, stream, seq, subject, m.encode(e), stored_ns, e, prev)
        apply(state, e)
        if batch.events >= commit_every:
            store.commit(batch, encode_state(state, cursor))
            batch = Batch()
    store.commit(batch, encode_state(state, cursor))
    return store
