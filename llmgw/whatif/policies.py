"""What if: the recorded history re-decided by the scheduler under another policy, and what it would have cost.

Pure, like the fold: no clock, no I/O; events come in the order the server stored
them (``llmgw.whatif.window`` reads the streams). One ``Replay`` feeds every policy at
once, so a sweep folds the history once and only the decisions differ:

* the fleet (nodes, GPUs, faults) is the recorded one, shared by every policy;
* operators' acts (declarations, scales, removals, ``ctl idle --stop``) are replayed,
  each declaration with the asked policy's knobs in its spec;
* the scheduler's acts are not: each policy's ``Sim`` calls ``scheduler.decide`` on
  its own fold and folds what it decides;
* engines: a replica the policy placed under the id and within a minute of a
  recorded one follows that replica's recorded reports (its start-up, its faults);
  any other starts and turns healthy after its model's median times in the
  ledger (the fleet's when the model has none);
* demand: each router's maps become the policy's maps: its recorded replicas'
  entries where the policy has the same replica, else the model's newest request
  for every healthy replica of the model; a request (or a recorded wish) for a
  model with no healthy replica under the policy is held, and wishes for it as
  the router would.

The same ``Meter`` measures the recorded history and each policy: GPU-hours held,
GPU-hours idle (stretches of at least ``IDLE_STRETCH_S`` without a request), cold
starts (wakes and scale-ups), requests that waited and their waits, minutes
unplaceable. ``fidelity`` is how much of the recorded history the recorded
policy reproduces: a what-if is only as good as that.

Over 600 lines: ``Sim`` (one policy's fold and decisions) and ``Replay`` (what feeds every
Sim alike) are two halves of one loop; each reads the other's state on every event.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.fleet.files import fetch_s
from llmgw.fleet.fold import Checkpoint, Memories, fold_batch
from llmgw.fleet.state import FleetState, ReplicaView, apply
from llmgw.scheduler import placement as scheduler
from llmgw.whatif.meter import Figures, Meter, StartTimes, holds, meter_event

LINK_S = 60.0  # a policy's replica follows a recorded one under its id placed within this long of it
DEBOUNCE_S = 0.05  # the live scheduler lets a burst land before it decides
MATCH_S = 60.0  # a placement or stop reproduced within a minute counts
FIDELITY_GOAL = 0.99
FIDELITY_WARN = 0.95
GPU_HOURS_GOAL = 0.02  # the recorded policy re-decided holds the recorded GPU-hours within this share
SERVED_KEPT = 64  # per model, the stretches with a healthy replica kept to place a late WakeAnswered's requests
MAX_PASSES = 5  # decide again while a pass decides something (a wake places in the pass after its scale)
QUIET_MAP_S = 60.0  # with no idle TTL and no autoscaling, a policy folds a router's map this often
SIM_KEEPS = Memories(history=False, demand=True, observed=False, pool=False, lost=False)


@dataclass(frozen=True)
class Policy:
    """What to change in declared specs. ``idle_ttl``: model → seconds (None: never), "" for every model;
    ``exclusive``: every replica on whole GPUs alone, as if declared ``--exclusive`` (``ctl what-if --pack``)."""

    label: str
    idle_ttl: tuple[tuple[str, float | None], ...] = ()
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_in_flight: float | None = None
    models: frozenset[str] = frozenset()  # empty: every model
    exclusive: bool = False

    def spec(self, spec: m.ModelSpec) -> m.ModelSpec:
        if self.models and spec.name not in self.models:
            return spec
        changes: dict[str, object] = {}
        ttls = dict(self.idle_ttl)
        if spec.name in ttls or "" in ttls:
            changes["idle_ttl_s"] = ttls.get(spec.name, ttls.get(""))
        if self.min_replicas is not None or self.max_replicas is not None:
            lo = self.min_replicas if self.min_replicas is not None else (spec.min_replicas or 0)
            hi = self.max_replicas if self.max_replicas is not None else (spec.max_replicas or max(spec.replicas, lo, 1))
            changes.update(min_replicas=lo, max_replicas=max(hi, lo, 1))
        if self.target_in_flight is not None:
            changes["target_in_flight"] = self.target_in_flight
        if self.exclusive and not spec.exclusive:
            changes["exclusive"] = True
        return msgspec.structs.replace(spec, **changes) if changes else spec


RECORDED = Policy(label="recorded")


# --- one policy --------------------------------------------------------------------------------------------------


class _Stored:
    __slots__ = ("seq", "subject", "ts_ns")

    def __init__(self, seq: int, subject: str, at: datetime) -> None:
        self.seq, self.subject, self.ts_ns = seq, subject, int(at.timestamp() * 1e9)


@dataclass
class _Recent:
    placed: m.ReplicaPlaced
    reports: list[m.ReplicaStateChanged] = field(default_factory=list)


@dataclass
class _Link:
    shift: timedelta
    nodes: tuple[str, ...]  # the policy's nodes, in the recorded replica's order


class Sim:
    """One policy re-deciding the recorded history: its own fold, the scheduler's decisions, a meter."""

    def __init__(self, policy: Policy, start: Checkpoint, nodes_shared: FleetState, since: datetime,
                 starts: StartTimes, recent: dict[str, _Recent], extra: tuple[m.NodeInventoryReported, ...] = ()) -> None:
        self.policy = policy
        self.c = start
        # The fleet is the recorded one, folded once for all; with nodes added (--fleet), its own copy.
        self.own_nodes = bool(extra)
        if extra:
            for inventory in extra:
                apply(self.c.state, msgspec.structs.replace(inventory, at=since))
        else:
            self.c.state.nodes = nodes_shared.nodes
            # What each node's disk holds, and the downloads it made, are the recorded fleet's too: a
            # placement where the files are not pays the download (``_start``).
            self.c.state.files, self.c.state.downloaded = nodes_shared.files, nodes_shared.downloaded
        for view in self.c.state.models.values():
            view.spec = policy.spec(view.spec)
        self.state = self.c.state
        self.memory = self.c.demand
        self.seq = {s: start.cursor.positions.get(s, 0) for s in subjects.HISTORY_STREAMS}
        self.meter = Meter(since, plane=self.state)
        self.starts = starts
        self.pending: list[tuple[datetime, int, m.Event]] = []  # (when, order, state report) heap
        self._order = 0
        self.links: dict[str, _Link] = {}
        self.placed_at: dict[str, datetime] = {}  # the policy's placements not yet linked or given up
        self.healthy_at: dict[str, datetime] = {}
        self.dirty_at: datetime | None = None
        self.expiry_at: datetime | None = None
        self.decided: list[tuple[str, str, datetime]] = []  # (placed|stopped, model, when) for fidelity
        self.folded_at: dict[str, datetime] = {}  # per router: the time of the last map folded
        self.now = since
        self.recent = recent  # the recorded placements of the last minute, and their reports, by id
        self.recorded_nodes: dict[str, tuple[str, ...]] = {}
        self.held: dict[str, int] = {}  # nodes the policy's replicas are on (a node's fault matters)
        # And their GPUs, with how many of its replicas book each (a GPU's fault matters while one does).
        self.held_gpus: dict[tuple[str, int], int] = {}
        # Per model, how many replicas are healthy, and the stretches when one was (the latest, for waits).
        self.healthy_n: dict[str, int] = {}
        self.served: dict[str, list[tuple[datetime, datetime | None]]] = {}
        self.moved: list[str] = []  # replicas running at the start placed again on whole GPUs (exclusive)
        self.unmoved: list[str] = []  # and those that found none there
        recorded = self._whole_from_start(since) if policy.exclusive else {}
        for rid, r in self.state.replicas.items():
            self.recorded_nodes[rid] = recorded.get(rid, r.nodes)
            self._hold(r, 1)
            self.meter.placed(rid, r.model, holds(self.state, r.gpus), r.placed_at, "")
            if r.state == "healthy":
                self.meter.healthy(rid, r.state_at or r.placed_at)
                self.healthy_at[rid] = r.state_at or r.placed_at
            self.links[rid] = _Link(timedelta(0), r.nodes)  # running at the start: the recorded replica
        for name in {r.model for r in self.state.replicas.values()}:
            self._serving(name, since)
        for name, view in self.state.models.items():
            if view.unplaceable_reason:
                self.meter.unplaceable_now(name, since)
        self._dirty(since)  # the policy's knobs (or nodes) take effect at once
        self._expiry()

    # --- folding its own history ---

    def _fold(self, stream: str, event: m.Event) -> None:
        self.seq[stream] += 1
        subject = subjects.usage_idle(event.router) if type(event) is m.IdleMapPublished else \
            subjects.subject_for(event)
        fold_batch(self.c, stream, [_Stored(self.seq[stream], subject, event.at)], [event], keep=SIM_KEEPS)

    def _whole_from_start(self, since: datetime) -> dict[str, tuple[str, ...]]:
        """Whole GPUs from the window's start, as if the policy had always held: the replicas running then
        that shared cards are placed again on whole GPUs (oldest first, by the scheduler's ``place``), and
        those that find none stop there. Returns the moved replicas' recorded nodes, by id."""
        state = self.state
        keep: dict[tuple[str, int], int] = {}
        moving: list[ReplicaView] = []
        for r in sorted(state.replicas.values(), key=lambda r: (r.placed_at, r.replica_id)):
            if r.spec.exclusive or self.policy.models and r.model not in self.policy.models:  # keeps its GPUs
                for g in r.gpus:
                    keep[(g.node, g.index)] = keep.get((g.node, g.index), 0) + state.ref_mib(g)
            else:
                moving.append(r)
        rooms: dict[str, scheduler.Room] = {}
        serving: dict[str, set[str]] = {}
        recorded: dict[str, tuple[str, ...]] = {}
        for r in moving:
            spec = self.policy.spec(r.spec)
            if spec.gpu_class not in rooms:
                rooms[spec.gpu_class] = scheduler.Room(state, keep, spec.gpu_class)
            avoid = serving.setdefault(r.model, set())
            where = scheduler.place(state, spec, rooms[spec.gpu_class], avoid)
            if where is None:
                self.unmoved.append(r.replica_id)
                self._fold(subjects.STREAM_CONTROL, m.ReplicaStopped(
                    at=since, replica_id=r.replica_id, model=r.model, code="spec_changed",
                    reason="what-if: no whole GPU for it at the window's start"))
                continue
            recorded[r.replica_id] = r.nodes
            r.nodes, r.gpus, r.fabric = where
            r.spec = spec
            avoid.update(r.nodes)
            self.moved.append(r.replica_id)
        return recorded

    def _hold(self, r: m.ReplicaPlaced | ReplicaView, n: int) -> None:
        for g in r.gpus:
            key = (g.node, g.index)
            if (left := self.held_gpus.get(key, 0) + n) > 0:
                self.held_gpus[key] = left
            else:
                self.held_gpus.pop(key, None)
        for node in r.nodes:
            left = self.held.get(node, 0) + n
            if left > 0:
                self.held[node] = left
            else:
                self.held.pop(node, None)

    def fleet(self, event: m.Event) -> None:
        """A fleet event (already in the shared fold): a pass is due if it touches a node the policy
        uses, or if it may be what a model short of replicas waits for (a GPU of its class back)."""
        if self.own_nodes:
            apply(self.state, event)
        node = getattr(event, "node", "")
        if type(event) in (m.DownloadProgressed, m.DownloadFinished):
            return  # a download going on changes no placement (a node's report of its files does)
        if type(event) is not m.GpuHealthChanged:  # a node's inventory, lost, back, retired, files: a pass
            self._dirty(event.at)
            return
        if (node, event.gpu_index) in self.held_gpus:
            if not event.healthy:
                self._dirty(event.at)  # one of ours went bad: re-placed
            return
        if not event.healthy:
            return  # a card lost where nothing of ours runs frees nothing
        # A card back helps only a model short of replicas of its class, and only if its node now has
        # room for one (a pass would otherwise only restate why the model does not fit).
        n = self.state.nodes.get(node)
        gpu = n.gpus.get(event.gpu_index) if n is not None else None
        if n is None or gpu is None:
            return
        need = [v.spec.tp for v in self.state.models.values()
                if v.unplaceable_reason and v.spec.gpu_class == gpu.gpu_class]
        if need and sum(1 for g in self.state.free_gpus(n, self.held_gpus) if g.gpu_class == gpu.gpu_class) >= min(need):
            self._dirty(event.at)

    def _control(self, event: m.Event) -> None:
        kind = type(event)
        if kind is m.ReplicaStopped and (gone := self.state.replicas.get(event.replica_id)) is not None:  # type: ignore[attr-defined]
            self._hold(gone, -1)
        self._fold(subjects.STREAM_CONTROL, event)
        if kind is m.ReplicaPlaced:
            self._hold(event, 1)  # type: ignore[arg-type]
        if kind is m.ReplicaStateChanged or kind is m.ReplicaStopped:
            self._serving(event.model, event.at)  # type: ignore[attr-defined]
        meter_event(self.meter, event, self.state)
        if type(event) is m.ReplicaStateChanged and event.state == "healthy":
            self.healthy_at.setdefault(event.replica_id, event.at)
        self._dirty(event.at)

    def plane(self, event: m.Event) -> None:
        """The control plane stopped or started: as every control event, and at a start its due passes run."""
        self._control(event)
        if type(event) is m.ControlPlaneStarted:
            self.now = max(self.now, event.at)

    def _serving(self, model: str, at: datetime) -> None:
        """Keep the stretches in which the model had a healthy replica: when a request would have waited."""
        n = sum(1 for r in self.state.replicas.values() if r.model == model and r.state == "healthy")
        was = self.healthy_n.get(model, 0)
        self.healthy_n[model] = n
        log = self.served.setdefault(model, [])
        if n and not was:
            log.append((at, None))
            if len(log) > SERVED_KEPT:
                del log[0]
        elif was and not n and log and log[-1][1] is None:
            log[-1] = (log[-1][0], at)

    def serving(self, model: str) -> bool:
        return self.healthy_n.get(model, 0) > 0

    def answered(self, model: str, arrivals: list[datetime]) -> None:
        """Requests the recorded router held (their arrival times, from ``WakeAnswered``): under this policy
        each waits until the model's next healthy replica, unless one was healthy when it came."""
        log = self.served.get(model, [])
        for a in arrivals:
            if any(start <= a and (end is None or a < end) for start, end in log):
                continue
            nxt = min((start for start, _ in log if start > a), default=None)
            if nxt is not None:
                self.meter.hold(model, a, 1)
                self.meter.release_one(model, a, nxt)
            else:
                self.meter.hold(model, a, 1)

    def _dirty(self, at: datetime) -> None:
        if self.dirty_at is None or at < self.dirty_at:
            self.dirty_at = at

    # --- time ---

    def advance(self, t: datetime) -> None:
        """Everything due before ``t``: engines' reports, then decisions, in time order; nothing while the
        control plane is down (what is due then is done when it starts again)."""
        while self.state.plane_down_since is None:
            due = [x for x in (self.pending[0][0] if self.pending else None,
                               self.dirty_at + timedelta(seconds=DEBOUNCE_S) if self.dirty_at else None,
                               self.expiry_at) if x is not None]
            if not due or (nxt := min(due)) > t:
                return
            while self.pending and self.pending[0][0] <= nxt:
                _, _, report = heapq.heappop(self.pending)
                if report.replica_id in self.state.replicas:  # type: ignore[attr-defined]
                    self._control(report)
            if self.dirty_at is not None and self.dirty_at + timedelta(seconds=DEBOUNCE_S) <= nxt or \
                    self.expiry_at is not None and self.expiry_at <= nxt:
                self.decide(nxt)

    def decide(self, now: datetime) -> None:
        self.now = max(self.now, now)
        self.dirty_at = None
        for _ in range(MAX_PASSES):
            decisions = scheduler.decide(self.state, self.memory, self.now)
            if not decisions:
                break
            for d in decisions:
                self._decided(d.event)
            self.dirty_at = None
        self._expiry()

    def _decided(self, event: m.Event) -> None:
        self._control(event)
        kind = type(event)
        if isinstance(event, m.ReplicaPlaced):
            rid = event.replica_id
            self.decided.append(("placed", event.model, event.at))
            self.placed_at[rid] = event.at
            self.healthy_at.pop(rid, None)
            self.links.pop(rid, None)
            recent = self.recent.get(rid)
            if recent is not None and recent.placed.model == event.model and \
                    abs((event.at - recent.placed.at).total_seconds()) <= LINK_S:
                self._link(rid, recent.placed)
                for report in recent.reports:
                    self.recorded_report(report)
            else:
                self._start(rid)
        elif kind is m.ReplicaStopped:
            self.decided.append(("stopped", event.model, event.at))  # type: ignore[attr-defined]
            self._gone(event.replica_id)  # type: ignore[attr-defined]

    def _gone(self, rid: str) -> None:
        self.links.pop(rid, None)
        self.placed_at.pop(rid, None)
        self.healthy_at.pop(rid, None)

    def _start(self, rid: str) -> None:
        """An engine of the policy's own: starting, then healthy, after its model's ledger times."""
        r = self.state.replicas[rid]
        started, healthy, _ = self.starts.of(r.model)
        # On nodes without its files, the engine starts only once they are fetched, at the recorded rate.
        fetch = fetch_s(self.state.files, self.state.downloaded, r.spec, r.nodes)
        started, healthy = started + fetch, healthy + fetch
        for state, after in (("starting", started), ("healthy", healthy)):
            for node in r.nodes:
                self._later(r.placed_at + timedelta(seconds=after), m.ReplicaStateChanged(
                    at=r.placed_at + timedelta(seconds=after), replica_id=rid, model=r.model, node=node,
                    state=state, endpoint="http://what-if"))  # type: ignore[arg-type]

    def _later(self, at: datetime, event: m.Event) -> None:
        self._order += 1
        heapq.heappush(self.pending, (at, self._order, event))

    def _expiry(self) -> None:
        """When the next idle stop or back-off ends: a pass is due then even if nothing happens."""
        soonest: datetime | None = None
        for r in self.state.replicas.values():
            model = self.state.models.get(r.model)
            ttl = model.spec.idle_ttl_s if model is not None else None
            if ttl:
                since = self.state.idle_since(r.replica_id)
                # The control plane's gaps since then do not count towards the TTL (``FleetState.idle_s``).
                if since is not None and (t := since + timedelta(
                        seconds=ttl + self.state.down_s(since, self.now))) > self.now:
                    soonest = t if soonest is None or t < soonest else soonest
        for name, at in self.memory.failed_at.items():
            t = at + timedelta(seconds=scheduler.backoff_s(self.memory.failures.get(name, 0)))
            if t > self.now:
                soonest = t if soonest is None or t < soonest else soonest
        self.expiry_at = soonest

    # --- the recorded history, as this policy sees it ---

    def operator(self, event: m.Event) -> None:
        """A declaration, scale or removal: replayed, declarations with the policy's knobs."""
        if type(event) is m.ModelDeclared:
            event = msgspec.structs.replace(event, spec=self.policy.spec(event.spec))
        self._control(event)

    def operator_stop(self, event: m.ReplicaStopped) -> None:
        """``ctl idle --stop``: the operator stops what the policy has under that id, if it has it."""
        if event.replica_id in self.state.replicas:
            self._control(event)
            self.decided.append(("stopped", event.model, event.at))
            self._gone(event.replica_id)

    def recorded_placed(self, event: m.ReplicaPlaced) -> None:
        """The scheduler placed this: the policy's replica of that id follows its reports if it is the same one."""
        rid = event.replica_id
        mine = self.state.replicas.get(rid)
        at = self.placed_at.get(rid)
        if mine is None or at is None or mine.model != event.model or abs((at - event.at).total_seconds()) > LINK_S:
            return
        self._link(rid, event)

    def _link(self, rid: str, placed: m.ReplicaPlaced) -> None:
        mine = self.state.replicas[rid]
        self.links[rid] = _Link(self.placed_at.pop(rid, mine.placed_at) - placed.at, mine.nodes)
        self.pending = [x for x in self.pending if x[2].replica_id != rid]  # type: ignore[attr-defined]
        heapq.heapify(self.pending)
        self.recorded_nodes[rid] = placed.nodes

    def recorded_report(self, event: m.ReplicaStateChanged) -> None:
        link = self.links.get(event.replica_id)
        if link is None or event.replica_id not in self.state.replicas:
            return
        rec_nodes = self.recorded_nodes.get(event.replica_id, link.nodes)
        node = event.node
        if node in rec_nodes and rec_nodes.index(node) < len(link.nodes):
            node = link.nodes[rec_nodes.index(node)]
        report = msgspec.structs.replace(event, at=event.at + link.shift, node=node)
        if link.shift > timedelta(0):
            self._later(report.at, report)
        else:
            self._control(report)

    def wish(self, event: m.ModelWanted, requests: int) -> None:
        """A request for a model with no healthy replica under this policy: held (``requests`` of them; 0 when
        the router will say which in its ``WakeAnswered``), and wished for while parked."""
        name = event.model
        if name not in self.state.models:
            return
        if requests:
            self.meter.hold(name, event.at, requests)
        if not any(r.model == name for r in self.state.replicas.values()):
            # Only a wish that wakes something calls for a pass: a model parked by an idle stop or scaled
            # to zero. One short of room (unplaceable) is retried by every pass anyway.
            view = self.state.models[name]
            wakes = bool(self.memory.idle_stops.get(name)) or (
                view.replicas_wanted == 0 and name in self.memory.zeroed_at)
            self._fold(subjects.STREAM_USAGE, msgspec.structs.replace(event, control_seq=self.seq[subjects.STREAM_CONTROL]))
            if wakes:
                self._dirty(event.at)

    def idle_map(self, rec: m.IdleMapPublished, requests: dict[str, datetime], autoscaled: bool) -> None:
        """A router's map as it would have been: ``requests`` is each model's newest request it had seen."""
        last: dict[str, datetime] = {}
        since: dict[str, datetime] = {}
        busy: dict[str, int] = {}
        for rid, r in self.state.replicas.items():
            if r.state != "healthy":
                continue
            if rid in self.links and rid not in self.placed_at:
                if (t := rec.last_request.get(rid)) is not None:
                    last[rid] = t
                elif (t := rec.serving_since.get(rid)) is not None:
                    since[rid] = t
                if (b := rec.busy.get(rid)) is not None:
                    busy[rid] = b
                continue
            healthy = self.healthy_at.get(rid, r.state_at or r.placed_at)
            t = requests.get(r.model)
            if t is not None and t >= healthy:
                last[rid] = t
                self.meter.request(rid, t)
            else:
                since[rid] = healthy
        for rid, t in last.items():
            if rid in self.links:
                self.meter.request(rid, t)
        # Decisions read a map for idle stops and the autoscaler; with neither in this policy's fleet,
        # a map a minute keeps the rest (requests in flight, which a scale-down waits out) current.
        timed = autoscaled or any(v.spec.idle_ttl_s for v in self.state.models.values())
        folded = self.folded_at.get(rec.router)
        if not timed and folded is not None and (rec.at - folded).total_seconds() < QUIET_MAP_S:
            return
        self.folded_at[rec.router] = rec.at
        event = msgspec.structs.replace(rec, last_request=last, serving_since=since, busy=busy,
                                        control_seq=self.seq[subjects.STREAM_CONTROL])
        self._fold(subjects.STREAM_USAGE, event)
        if autoscaled:
            self._dirty(rec.at)
        if timed:
            self._expiry()


# --- the recorded history, fed once to every policy ---------------------------------------------------------------


@dataclass
class Outcome:
    """What ``Replay.finish`` returns: figures per policy, the recorded ones, fidelity, notes."""

    recorded: dict[str, Figures]
    recorded_total: Figures
    asked: dict[str, dict[str, Figures]]  # policy label → model → figures
    asked_total: dict[str, Figures]
    replayed_total: Figures
    recorded_all: Figures  # over every model: what fidelity compares
    reproduced: float
    recorded_decisions: int
    matched: int
    gpu_hours_diff: float | None
    starts: dict[str, tuple[float, float, str]]
    # Per exclusive policy: replicas running at the start placed again on whole GPUs, and those that found none.
    whole_start: dict[str, tuple[int, int]] = field(default_factory=dict)


class Replay:
    """The recorded history from ``since``, event by event in stored order, to every policy at once."""

    def __init__(self, start: Checkpoint, policies: list[Policy], since: datetime,
                 extra: tuple[m.NodeInventoryReported, ...] = (), live: FleetState | None = None) -> None:
        """``extra``: nodes the asked policies have besides the recorded fleet (not the recorded replay).
        ``live``: the recorded fold the caller goes on folding, when ``start`` is a copy of it as of ``since``
        (it may be ahead of ``since`` already; the policies start from ``start``)."""
        self.since = since
        self.state = start.state if live is None else live
        self.starts = StartTimes()
        self.recorded = Meter(since, wishes=True, plane=start.state)
        self.recorded_decisions: list[tuple[str, str, datetime]] = []
        self.rid_model: dict[str, str] = {r: v.model for r, v in start.state.replicas.items()}
        for rid, r in start.state.replicas.items():
            self.recorded.placed(rid, r.model, holds(start.state, r.gpus), r.placed_at, "")
            if r.state == "healthy":
                self.recorded.healthy(rid, r.state_at or r.placed_at)
        for name, view in start.state.models.items():
            self.starts.seed(start.history.cold_starts(name))
            if view.unplaceable_reason:
                self.recorded.unplaceable_now(name, since)
        for r in start.state.replicas.values():  # running at the start: how long each took to be healthy
            if r.state == "healthy" and r.restarts == 0 and r.state_at is not None:
                h = (r.state_at - r.placed_at).total_seconds()
                self.starts.samples.setdefault(r.model, []).append((h, h))
        blob = _ENC.encode(start)
        self.recent: dict[str, _Recent] = {}
        self.sims = [Sim(p, _DEC.decode(blob), self.state, since, self.starts, self.recent,
                         extra if p is not RECORDED else ()) for p in [RECORDED, *policies]]
        self.mapped: set[str] = set()  # the routers whose maps the window has shown
        self.requests: dict[str, dict[str, datetime]] = {}  # router → model → newest request
        self.now = since

    def feed(self, stream: str, event: m.Event, moved: list[str] | None = None) -> None:
        """One recorded event, folded already (times clamped, refused ones left out); ``moved``: an idle
        map's ``requests_moved``, as the fold computed it."""
        at = event.at
        if at > self.now:
            self.now = at
        kind = type(event)
        upto = self.now
        if kind is m.ControlPlaneStarted and (began := self.recorded.gap_before(event)) is not None:  # type: ignore[arg-type]
            upto = min(upto, began)  # a kill -9's gap, known only now: nothing was decided in it
        for sim in self.sims:
            sim.advance(upto)
        if kind is m.IdleMapPublished:
            self._map(event, moved)  # type: ignore[arg-type]
        elif stream == subjects.STREAM_FLEET:
            for sim in self.sims:
                sim.fleet(event)
        elif kind is m.ModelWanted:
            self._wanted(event)  # type: ignore[arg-type]
        elif isinstance(event, m.WakeAnswered):
            self.recorded.waits(event.model, event.waits_s)
            arrivals = [event.released_at - timedelta(seconds=w) for w in event.waits_s]
            arrivals += [event.held_since] * max(event.requests - len(arrivals), 0)
            for sim in self.sims:
                sim.answered(event.model, arrivals)
        elif stream == subjects.STREAM_CONTROL:
            self._control(event)

    def _control(self, event: m.Event) -> None:
        kind = type(event)
        meter_event(self.recorded, event, self.state)
        self.starts.note(event)
        if kind is m.ReplicaPlaced:
            self.rid_model[event.replica_id] = event.model  # type: ignore[attr-defined]
            self.recorded_decisions.append(("placed", event.model, event.at))  # type: ignore[attr-defined]
            self._forget(event.at)
            self.recent[event.replica_id] = _Recent(event)  # type: ignore[arg-type, attr-defined]
            for sim in self.sims:
                sim.recorded_placed(event)  # type: ignore[arg-type]
        elif kind is m.ReplicaStateChanged:
            if (recent := self.recent.get(event.replica_id)) is not None:  # type: ignore[attr-defined]
                recent.reports.append(event)  # type: ignore[arg-type]
            for sim in self.sims:
                sim.recorded_report(event)  # type: ignore[arg-type]
        elif kind is m.ReplicaStopped:
            self.recorded_decisions.append(("stopped", event.model, event.at))  # type: ignore[attr-defined]
            if event.reason == "idle":  # type: ignore[attr-defined]  # ctl idle --stop's; the scheduler says more
                for sim in self.sims:
                    sim.operator_stop(event)  # type: ignore[arg-type]
        elif kind in (m.ModelDeclared, m.ModelScaled, m.ModelRemoved):
            for sim in self.sims:
                sim.operator(event)
        elif kind is m.ControlPlaneStopped or kind is m.ControlPlaneStarted:
            for sim in self.sims:  # folded (its idle times leave the gap out), metered, and a pass at the start
                sim.plane(event)

    def _forget(self, now: datetime) -> None:
        """Recorded placements older than a minute can link no replica any more."""
        while self.recent:
            rid, first = next(iter(self.recent.items()))
            if (now - first.placed.at).total_seconds() <= LINK_S:
                return
            del self.recent[rid]

    def _wanted(self, event: m.ModelWanted) -> None:
        self.recorded.hold(event.model, event.at, event.waiting)
        for sim in self.sims:
            if sim.serving(event.model):
                seen = self.requests.setdefault(event.router, {})
                if event.at > seen.get(event.model, event.at - timedelta(days=1)):
                    seen[event.model] = event.at
            else:
                sim.wish(event, 0)  # the requests are counted from the router's WakeAnswered

    def _map(self, event: m.IdleMapPublished, moved: list[str] | None) -> None:
        lr = event.last_request
        # A router's first map in the window is news whole; after it, what the fold found moved.
        first = event.router not in self.mapped
        self.mapped.add(event.router)
        fresh = lr if first or moved is None else moved
        seen = self.requests.setdefault(event.router, {})
        news: dict[str, tuple[datetime, int]] = {}
        for rid in fresh:
            t = lr[rid]
            self.recorded.request(rid, t)
            model = self.rid_model.get(rid)
            if model is None:
                continue
            if model not in seen or t > seen[model]:
                seen[model] = t
                load = event.load.get(model)
                news[model] = (t, max(1, load.in_flight + load.queued) if load else 1)
        autoscaled = any(v.spec.autoscaled for v in self.state.models.values())
        for sim in self.sims:
            for model, (t, n) in news.items():
                if not sim.serving(model):
                    sim.wish(m.ModelWanted(at=t, router=event.router, boot_id=event.boot_id, model=model,
                                           control_seq=0, waiting=n), n)
            sim.idle_map(event, seen, autoscaled or any(v.spec.autoscaled for v in sim.state.models.values()))

    def finish(self, until: datetime, models: tuple[str, ...] = ()) -> Outcome:
        """Every policy to ``until``; totals over ``models`` (all when empty), fidelity over all."""
        for sim in self.sims:
            sim.advance(until)
        recorded = self.recorded.close(until)
        asked: dict[str, dict[str, Figures]] = {}
        totals: dict[str, Figures] = {}
        for sim in self.sims[1:]:
            asked[sim.policy.label] = sim.meter.close(until)
            totals[sim.policy.label] = sim.meter.total(models)
        replay = self.sims[0]
        replay.meter.close(until)
        matched = _matched(self.recorded_decisions, replay.decided)
        rec_total, rep_total = self.recorded.total(), replay.meter.total()
        picked = self.recorded.total(models)
        diff = None if rec_total.gpu_hours == 0 else (rep_total.gpu_hours - rec_total.gpu_hours) / rec_total.gpu_hours
        n = len(self.recorded_decisions)
        names = sorted(set(self.state.models) | set(recorded))
        return Outcome(recorded=recorded, recorded_total=picked, asked=asked, asked_total=totals,
                       replayed_total=rep_total, recorded_all=rec_total, reproduced=matched / n if n else 1.0,
                       recorded_decisions=n, matched=matched, gpu_hours_diff=diff,
                       starts={x: self.starts.of(x) for x in names},
                       whole_start={sim.policy.label: (len(sim.moved), len(sim.unmoved))
                                    for sim in self.sims[1:] if sim.policy.exclusive})


def _matched(recorded: list[tuple[str, str, datetime]], replayed: list[tuple[str, str, datetime]]) -> int:
    """How many recorded placements and stops the replay made too: same kind, same model, within a minute."""
    by: dict[tuple[str, str], list[datetime]] = {}
    for kind, model, at in replayed:
        by.setdefault((kind, model), []).append(at)
    matched = 0
    rec: dict[tuple[str, str], list[datetime]] = {}
    for kind, model, at in recorded:
        rec.setdefault((kind, model), []).append(at)
    for key, times in rec.items():
        mine = sorted(by.get(key, ()))
        times.sort()
        i = j = 0
        while i < len(times) and j < len(mine):
            d = (mine[j] - times[i]).total_seconds()
            if abs(d) <= MATCH_S:
                matched += 1
                i += 1
                j += 1
            elif d < 0:
                j += 1
            else:
                i += 1
    return matched


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(Checkpoint)
