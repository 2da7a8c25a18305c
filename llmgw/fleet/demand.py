"""The scheduler's demand memory: what it needs beyond the fleet fold, itself a pure fold of control and usage.

Kept in the fleet core beside the fold, so that every reader folds it by the one
rule (``llmgw.fleet.checkpoint``) and a fold snapshot carries it; the scheduler
decides from it (``llmgw.scheduler.decide``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from llmgw import messages as m
from llmgw import subjects
from llmgw.fleet.state import FleetState

# The autoscaler's windows, in router ticks of the fleet's clock (not in maps: several routers
# publish several maps a tick): scale up once every map of the last UP_SAMPLES ticks asks for
# more, down once every map of the last DOWN_SAMPLES ticks asks for fewer (with a 10 s router
# tick, 30 s and 5 min, like Kubernetes' HPA defaults), the same with one router or five.
UP_SAMPLES = 3
DOWN_SAMPLES = 30
DEFAULT_TICK_S = 10.0  # a map that does not say its tick (older routers)
MAX_SAMPLES = 4096  # per model: routers x DOWN_SAMPLES maps are kept; past this, the oldest go
# A router's load counts until it misses this many of its ticks (at least STALE_MIN_S).
STALE_TICKS = 3
STALE_MIN_S = 30.0
# Wishes are kept per model name, also for names not declared (yet: a replay may fold a wish
# before its model's declaration); past this many, wishes for undeclared names are dropped.
MAX_WISHES = 10_000


@dataclass
class Wish:
    """The newest ``ModelWanted`` for a model: a router waiting, and how much of control it had seen."""

    control_seq: int
    router: str
    waiting: int


@dataclass
class RouterLoad:
    """One router's latest demand report (from its idle map)."""

    at: datetime
    stale_after_s: float
    load: dict[str, m.ModelLoad]
    busy: dict[str, int]


@dataclass
class SchedulerMemory:
    """What the scheduler needs beyond the shared fold, itself a pure fold of control and usage.

    Idle stops park a model until the operator deploys or scales it again, or a
    router wants it: ``idle_stops`` holds the control sequences of those not yet
    answered by a wish, and a wish answers every stop at or before the control
    sequence its router had seen. Both sides are sets and maxima over sequences,
    so the result is the same however the usage and control streams interleave.
    """

    placed: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    failed_at: dict[str, datetime] = field(default_factory=dict)
    # Ascending (control order), not sets: a checkpoint's bytes must not depend on how the usage
    # and control streams interleaved as they were read.
    idle_stops: dict[str, list[int]] = field(default_factory=dict)
    last_idle_stop: dict[str, int] = field(default_factory=dict)
    wished: dict[str, Wish] = field(default_factory=dict)
    # The control sequence of the autoscaler's latest scale to zero, per model.
    zeroed_at: dict[str, int] = field(default_factory=dict)
    autoscalings: dict[str, int] = field(default_factory=dict)
    routers: dict[str, RouterLoad] = field(default_factory=dict)
    # Per model, (the map's time, its router's control sequence, demand summed over live routers,
    # the router's tick) at each router map, in the order read, for the last DOWN_SAMPLES ticks
    # (one older, to show the window is covered); and the control sequence of its count's last change.
    windows: dict[str, list[tuple[datetime, int, int, float]]] = field(default_factory=dict)
    count_changed_at: dict[str, int] = field(default_factory=dict)
    refused_claims: int = 0
    # Wishes for a model not declared when they were read: this reader's counter, not part of the
    # fold (it depends on how the usage and control streams interleaved as read), so not a field
    # and never in a checkpoint.
    ignored_wishes = 0

    def parked(self, model: str) -> int:
        return len(self.idle_stops.get(model, ()))

    def busy(self, replica_id: str) -> bool:
        """Whether any live router has a request in flight to this replica."""
        return any(r.busy.get(replica_id, 0) > 0 for r in self.routers.values())

    def _forget(self, name: str) -> None:
        for d in (self.idle_stops, self.last_idle_stop, self.failures, self.failed_at, self.zeroed_at):
            d.pop(name, None)


def observe(memory: SchedulerMemory, event: m.Event, state: FleetState, seq: int = 0, subject: str = "") -> SchedulerMemory:
    """Fold one event into the memory; call it BEFORE ``fold.apply`` of the same event.

    ``seq`` is the event's sequence in its stream and ``subject`` what it was
    published on (a usage event whose subject names another router is refused).
    """
    match event:
        case m.IdleMapPublished():
            observe_idle_map(memory, event, subject)
        case m.ModelWanted():
            if subject and not subjects.usage_speaks_for(subject, event.router):
                memory.refused_claims += 1
                return memory
            if event.model not in state.models:
                memory.ignored_wishes += 1  # removed or never declared: counted, never placed
                if len(memory.wished) >= MAX_WISHES:
                    return memory  # a flood of made-up names must not grow the scheduler without bound
            known = memory.wished.get(event.model)
            if known is None or event.control_seq > known.control_seq:
                memory.wished[event.model] = Wish(event.control_seq, event.router, event.waiting)
                stops = memory.idle_stops.get(event.model)
                if stops:
                    memory.idle_stops[event.model] = [x for x in stops if x > event.control_seq]
        case m.ModelDeclared(spec=spec):
            memory._forget(spec.name)
            memory.count_changed_at[spec.name] = seq
        case m.ModelScaled(name=name):
            memory.idle_stops.pop(name, None)
            memory.zeroed_at.pop(name, None)
            memory.count_changed_at[name] = seq
        case m.ModelAutoscaled(name=name, replicas=replicas):
            memory.autoscalings[name] = memory.autoscalings.get(name, 0) + 1
            memory.count_changed_at[name] = seq
            if replicas == 0:
                memory.zeroed_at[name] = seq
            else:
                memory.zeroed_at.pop(name, None)
        case m.ModelRemoved(name=name):
            memory._forget(name)
        case m.ReplicaPlaced(model=model):
            memory.placed[model] = memory.placed.get(model, 0) + 1
        case m.ReplicaStateChanged(replica_id=rid, model=model, node=node, state="healthy"):
            # Only the model's own replica, from a node it was placed on, says the model runs again:
            # any other report (another model's replica, one nobody placed) would lift its back-off.
            replica = state.replicas.get(rid)
            if replica is not None and replica.model == model and node in replica.nodes:
                memory.failures.pop(model, None)
                memory.failed_at.pop(model, None)
        case m.ReplicaStopped(replica_id=rid, model=model):
            if (replica := state.replicas.get(rid)) is not None and replica.model == model:
                code = event.stop_code  # the code; for an event written before codes, its wording's
                if code == "idle":
                    memory.last_idle_stop[model] = max(memory.last_idle_stop.get(model, 0), seq)
                    wish = memory.wished.get(model)
                    if wish is None or seq > wish.control_seq:  # else a router already wanted it back
                        stops = memory.idle_stops.setdefault(model, [])
                        if seq not in stops:
                            stops.append(seq)
                elif code == "engine_failed":
                    memory.failures[model] = memory.failures.get(model, 0) + 1
                    memory.failed_at[model] = event.at
        case _:
            pass
    return memory


def observe_idle_map(memory: SchedulerMemory, event: m.IdleMapPublished, subject: str = "") -> None:
    """``observe`` of an idle map: a router's demand report (every fold runs it for most of the usage stream)."""
    if subject and not subjects.usage_speaks_for(subject, event.router):
        memory.refused_claims += 1
        return
    routers, at = memory.routers, event.at
    routers[event.router] = RouterLoad(at, max(STALE_TICKS * event.tick_s, STALE_MIN_S), event.load, event.busy)
    if len(routers) > 1:
        # A router that stopped reporting (stopped, cut off) must not hold its last load forever.
        for name in [n for n, r in routers.items() if (at - r.at).total_seconds() > r.stale_after_s]:
            del routers[name]
    totals: dict[str, int] = {}
    for r in routers.values():
        if r.load:
            for model, load in r.load.items():
                totals[model] = totals.get(model, 0) + load.in_flight + load.queued
    tick = event.tick_s or DEFAULT_TICK_S
    keep = timedelta(seconds=(DOWN_SAMPLES + 1) * tick)
    for model, total in totals.items():
        window = memory.windows.setdefault(model, [])
        window.append((at, event.control_seq, total, tick))
        while len(window) > MAX_SAMPLES or (len(window) > 1 and at - window[1][0] > keep):
            del window[0]


def agreeing(window: list[tuple[datetime, int, int, float]], since: int, ticks: int) -> list[int] | None:
    """The demands of every map of the last ``ticks`` router ticks that saw control ``since``, or None
    while such maps cover less than that (time, not a count of maps: the same with any number of routers)."""
    seen = [(at, total, tick) for at, seq, total, tick in window if seq >= since]
    if not seen:
        return None
    newest, tick = max(at for at, _, _ in seen), seen[-1][2]
    span = timedelta(seconds=ticks * tick)
    # A map stands for the tick before it: the oldest covers from one tick before its time.
    if newest - min(at for at, _, _ in seen) + timedelta(seconds=tick) < span:
        return None
    return [total for at, total, _ in seen if at > newest - span]
