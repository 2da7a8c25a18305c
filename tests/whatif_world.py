"""A recorded history as the live control plane makes it, in virtual time: requests, a router, the real
scheduler deciding every second and after every event, agents whose engines start in fixed times.

What ``ctl what-if`` is checked against: re-deciding this history under its own policy must
reproduce it, and a history whose answer is known by hand must give that answer.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from llmgw import messages as m
from llmgw import subjects
from llmgw.fleet.fold import Checkpoint, Memories, fold_batch
from llmgw.scheduler import placement as scheduler

T0 = datetime(2026, 3, 2, tzinfo=UTC)
ROUTER = "gw"
KEEP = Memories(history=False, demand=True, observed=False, pool=False, lost=False)


def spec(name: str, *, ttl: float | None = None, tp: int = 1, lo: int | None = None, hi: int | None = None,
         target: float = 4.0, gib: float = 0.0) -> m.ModelSpec:
    """A vLLM model (it books what vLLM takes: most of a card), or with ``gib`` a llama.cpp one whose plan
    charges that much per GPU: one that shares a card."""
    if gib:
        return m.ModelSpec(name=name, source=f"./models/{name}.gguf", precision="q4_K_M", engine="llama.cpp",
                           gpu_class="H100-80GB", context=8192, tp=tp, idle_ttl_s=ttl, min_replicas=lo,
                           max_replicas=hi, target_in_flight=target, gib_per_gpu=gib)
    return m.ModelSpec(name=name, source=f"org/{name}", precision="bf16", engine="vllm", gpu_class="H100-80GB",
                       context=8192, tp=tp, idle_ttl_s=ttl, min_replicas=lo, max_replicas=hi, target_in_flight=target)


def inventory(node: str, gpus: int, at: datetime) -> m.NodeInventoryReported:
    return m.NodeInventoryReported(at=at, node=node, fabric="ib-a", fabric_source="fleet-file", boot_id=f"{node}-0",
                                   simulated=True,
                                   gpus=tuple(m.GpuInfo(index=i, uuid=f"GPU-{node}-{i}", name="H100", gpu_class="H100-80GB",
                                                        memory_mib=81559) for i in range(gpus)))


class _At:
    __slots__ = ("seq", "subject", "ts_ns")

    def __init__(self, seq: int, subject: str, at: datetime) -> None:
        self.seq, self.subject, self.ts_ns = seq, subject, int(at.timestamp() * 1e9)


@dataclass
class World:
    """Everything published, in order, as (stream, event); ``run`` drives it."""

    nodes: int = 2
    gpus: int = 4
    tick_s: float = 10.0
    started_s: float = 0.5
    healthy_s: float = 2.0
    serve_s: float = 1.0
    out: list[tuple[str, m.Event]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.c = Checkpoint()
        self.seq = {s: 0 for s in subjects.HISTORY_STREAMS}
        self.timers: list[tuple[datetime, int, str, object]] = []
        self.order = itertools.count()
        self.held: dict[str, list[datetime]] = {}
        self.last_request: dict[str, datetime] = {}
        self.pooled: dict[str, datetime] = {}  # healthy replicas in the router's pool, since when
        self.busy_until: dict[str, list[datetime]] = {}
        self.wished_tick: dict[str, int] = {}
        self.answered: list[m.WakeAnswered] = []
        self.tick = 0
        self.dirty = False

    def publish(self, stream: str, event: m.Event) -> None:
        self.seq[stream] += 1
        subject = subjects.usage_idle(ROUTER) if type(event) is m.IdleMapPublished else subjects.subject_for(event)
        fold_batch(self.c, stream, [_At(self.seq[stream], subject, event.at)], [event], keep=KEEP)
        self.out.append((stream, event))
        if stream != subjects.STREAM_USAGE or type(event) is m.ModelWanted:
            self.dirty = True

    def at(self, t: datetime, kind: str, what: object = None) -> None:
        heapq.heappush(self.timers, (t, next(self.order), kind, what))

    def start(self, specs: list[m.ModelSpec], requests: list[tuple[float, str]],
              later: Sequence[tuple[float, m.ModelSpec | str]] = ()) -> None:
        """``later``: (seconds from T0, a spec declared then, or the name of a model removed then)."""
        for i in range(self.nodes):
            self.publish(subjects.STREAM_FLEET, inventory(f"n{i}", self.gpus, T0))
        for s in specs:
            self.publish(subjects.STREAM_CONTROL, m.ModelDeclared(at=T0, spec=s))
        for offset, model in requests:
            self.at(T0 + timedelta(seconds=offset), "request", model)
        for offset, act in later:
            self.at(T0 + timedelta(seconds=offset), "operator", act)

    def _operator(self, t: datetime, act: object) -> None:
        if isinstance(act, m.ModelSpec):
            self.publish(subjects.STREAM_CONTROL, m.ModelDeclared(at=t, spec=act))
        else:
            self.publish(subjects.STREAM_CONTROL, m.ModelRemoved(at=t, name=str(act)))

    def run(self, hours: float) -> list[tuple[str, m.Event]]:
        end = T0 + timedelta(hours=hours)
        self.at(T0 + timedelta(seconds=self.tick_s), "tick")
        self.at(T0 + timedelta(seconds=1), "second")
        while self.timers and self.timers[0][0] <= end:
            t, _, kind, what = heapq.heappop(self.timers)
            getattr(self, f"_{kind}")(t, what)
            if self.dirty and kind not in ("decide",):
                self.dirty = False
                self.at(t + timedelta(seconds=0.05), "decide")
        return self.out

    # --- the scheduler ---

    def _decide(self, t: datetime, _: object) -> None:
        for d in scheduler.decide(self.c.state, self.c.demand, t):
            self.publish(subjects.STREAM_CONTROL, d.event)
            if type(d.event) is m.ReplicaPlaced:
                r = d.event
                for node in r.nodes:
                    self.at(t + timedelta(seconds=self.started_s), "report", (r.replica_id, r.model, node, "starting"))
                    self.at(t + timedelta(seconds=self.healthy_s), "report", (r.replica_id, r.model, node, "healthy"))
            elif type(d.event) is m.ReplicaStopped:
                self.pooled.pop(d.event.replica_id, None)
        self.dirty = False

    def _second(self, t: datetime, _: object) -> None:
        self._decide(t, None)
        self.at(t + timedelta(seconds=1), "second")

    # --- the agents ---

    def _report(self, t: datetime, what: object) -> None:
        rid, model, node, state = what  # type: ignore[misc]
        if rid not in self.c.state.replicas:
            return
        self.publish(subjects.STREAM_CONTROL, m.ReplicaStateChanged(
            at=t, replica_id=rid, model=model, node=node, state=state, endpoint=f"http://{node}:8000"))
        if state == "healthy":
            self.pooled[rid] = t
            self._release(t, model, rid)

    # --- the router ---

    def _serve(self, t: datetime, rid: str) -> None:
        self.last_request[rid] = t
        self.busy_until.setdefault(rid, []).append(t + timedelta(seconds=self.serve_s))

    def _request(self, t: datetime, model: str) -> None:
        reps = [rid for rid in self.pooled if self.c.state.replicas.get(rid) and
                self.c.state.replicas[rid].model == model]
        if reps:
            self._serve(t, min(reps, key=lambda r: (len(self.busy_until.get(r, ())), r)))
            return
        self.held.setdefault(model, []).append(t)
        if not any(r.model == model for r in self.c.state.replicas.values()):
            self._wish(t, model)

    def _wish(self, t: datetime, model: str) -> None:
        if self.wished_tick.get(model) == self.tick:
            return
        self.wished_tick[model] = self.tick
        self.publish(subjects.STREAM_USAGE, m.ModelWanted(
            at=t, router=ROUTER, boot_id="b", model=model, control_seq=self.seq[subjects.STREAM_CONTROL],
            waiting=len(self.held[model])))

    def _release(self, t: datetime, model: str, rid: str) -> None:
        held = self.held.pop(model, [])
        if not held:
            return
        for _ in held:
            self._serve(t, rid)
        self.answered.append(m.WakeAnswered(
            at=t + timedelta(seconds=0.01), router=ROUTER, boot_id="b", model=model, replica_id=rid,
            held_since=min(held), released_at=t, requests=len(held),
            waits_s=tuple(round((t - h).total_seconds(), 4) for h in held)))

    def _tick(self, t: datetime, _: object) -> None:
        self.tick += 1
        for rid in [r for r in self.pooled if r not in self.c.state.replicas]:
            del self.pooled[rid]
        for rid in list(self.busy_until):
            self.busy_until[rid] = [x for x in self.busy_until[rid] if x > t]
            if not self.busy_until[rid] or rid not in self.pooled:
                del self.busy_until[rid]
        last = {rid: v for rid, v in self.last_request.items() if rid in self.pooled}
        since = {rid: v for rid, v in self.pooled.items() if rid not in last}
        busy = {rid: len(v) for rid, v in self.busy_until.items()}
        load = {}
        for name in self.c.state.models:
            flight = sum(n for rid, n in busy.items() if self.c.state.replicas[rid].model == name)
            load[name] = m.ModelLoad(in_flight=flight, queued=len(self.held.get(name, ())),
                                     replicas=sum(1 for r in self.pooled if self.c.state.replicas[r].model == name))
        self.publish(subjects.STREAM_USAGE, m.IdleMapPublished(
            at=t, router=ROUTER, boot_id="b", tick=self.tick, last_request=last, serving_since=since, load=load,
            busy=busy, tick_s=self.tick_s, control_seq=self.seq[subjects.STREAM_CONTROL]))
        for model, held in self.held.items():
            if held and not any(r.model == model for r in self.c.state.replicas.values()):
                self._wish(t, model)
        for a in self.answered:
            self.publish(subjects.STREAM_USAGE, a)
        self.answered.clear()
        self.at(t + timedelta(seconds=self.tick_s), "tick")


def history(specs: list[m.ModelSpec], requests: list[tuple[float, str]], hours: float,
            later: Sequence[tuple[float, m.ModelSpec | str]] = (), **kw: float) -> list[tuple[str, m.Event]]:
    w = World(**kw)  # type: ignore[arg-type]
    w.start(specs, requests, later)
    return w.run(hours)


def every(model: str, start_s: float, end_s: float, gap_s: float) -> Iterator[tuple[float, str]]:
    t = start_s
    while t < end_s:
        yield t, model
        t += gap_s
