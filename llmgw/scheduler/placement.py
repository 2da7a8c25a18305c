"""Pure placement: what should run where, decided from the folded fleet state.

``decide(state, memory, now)`` returns the events a scheduler should publish
(``ReplicaStopped``, ``ReplicaPlaced``, ``ModelUnplaceable``), each paired
with a deterministic ``Nats-Msg-Id``: two schedulers that see the same history
make the same decisions under the same ids, and JetStream keeps one of each.

A replica takes ``tp`` healthy GPUs of its class on one node, or, with ``pp > 1``,
``tp`` GPUs on each of ``pp`` nodes of ONE fabric; never across. On each it books
what its plan needs there (``booking_mib``); a GPU holds replicas while their
bookings fit its memory, and an exclusive replica holds whole GPUs alone. Among the nodes it
fits on, one whose disk holds its files complete (``llmgw.fleet.files.holders``) comes first: a
download is minutes where a start from disk is seconds. Whole GPUs: the GPUs and nodes with fewer recent
faults first (``FleetState.faults``, a week); a partly booked GPU is the tightest fit, by bisection.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import defaultdict
from collections.abc import Callable, Container
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from operator import attrgetter

import msgspec

from llmgw import messages as m
from llmgw.fleet.demand import DOWN_SAMPLES, UP_SAMPLES, SchedulerMemory, agreeing
from llmgw.fleet.files import by_source, expected_bytes_of, gib, holders_of
from llmgw.fleet.state import FleetState, GpuView, NodeView, ReplicaView, booking_mib, by_fabric
from llmgw.scheduler.maintenance import QUARANTINE, Quarantine, quarantines

# Back-off for a model whose replicas keep failing: 5 s, 10 s, 20 s, … at most 5 min.
BACKOFF_BASE_S = 5.0
BACKOFF_MAX_S = 300.0


@dataclass(frozen=True)
class Decision:
    """One event to publish and the id that makes publishing it idempotent."""

    event: m.Event
    msg_id: str


def backoff_s(failures: int) -> float:
    """Seconds to wait before placing a model again after ``failures`` failed replicas."""
    if failures <= 0:
        return 0.0
    return min(BACKOFF_BASE_S * 2 ** (failures - 1), BACKOFF_MAX_S)


def replica_id(model: str, n: int) -> str:
    """The n-th replica ever placed for a model: the same in every scheduler that folds the same history."""
    return f"{model}-r{n}"


def _lost_reason(state: FleetState, replica: ReplicaView) -> tuple[str, str] | None:
    """Why a replica can no longer run where it is (code, sentence), or None when its GPUs are fine."""
    for ref in replica.gpus:
        node = state.nodes.get(ref.node)
        if node is None:
            return "node_lost", f"node {ref.node} is unknown"
        if node.lost:
            return "node_lost", f"node {ref.node} lost (no heartbeat)"
        gpu = node.gpus.get(ref.index)
        if gpu is None or gpu.uuid != ref.uuid:
            return "gpu_unhealthy", f"GPU {ref.index} ({ref.uuid}) on {ref.node} is gone"
        if not gpu.healthy:
            why = ", ".join(gpu.reasons) or "no reason given"
            return "gpu_unhealthy", f"GPU {ref.index} ({ref.uuid}) on {ref.node} unhealthy: {why}"
    return None


class Room:
    """What one GPU class has free in a pass, kept current as replicas are placed and stopped.

    ``whole``: the GPUs nothing is booked on, by node (what exclusive, multi-GPU and multi-node
    replicas take); ``part``: the partly booked ones as (free MiB, node, index), sorted, so that
    a small replica finds the tightest GPU it fits by bisection instead of a walk over the fleet.
    """

    def __init__(self, state: FleetState, booked: dict[tuple[str, int], int], gpu_class: str,
                 cordoned: Container[str] | None = None) -> None:
        cordoned = state.cordoned if cordoned is None else cordoned
        self.whole: dict[str, list[GpuView]] = {}
        self.part: list[tuple[int, str, int]] = []
        self.part_free: dict[tuple[str, int], int] = {}  # the same by GPU: a node's GPUs without a search
        self.card_mib = 0  # the class's smallest card: a booking's size for the bisection
        # Recent faults by node and by GPU, only where there are any (most passes: none, and no cost).
        faults = state.faults
        self.node_faults: dict[str, int] = {}
        for node in state.nodes.values():
            if node.lost or node.name in cordoned:  # cordoned: nothing new goes there
                continue
            for g in node.gpus.values():
                if g.gpu_class != gpu_class or not g.healthy:
                    continue
                if faults and (f := len(faults.get(g.uuid, ()))):
                    self.node_faults[node.name] = self.node_faults.get(node.name, 0) + f
                self.card_mib = min(self.card_mib or g.memory_mib, g.memory_mib)
                used = booked.get((node.name, g.index), 0)
                if not used:
                    self.whole.setdefault(node.name, []).append(g)
                elif used < g.memory_mib:
                    self.part.append((g.memory_mib - used, node.name, g.index))
                    self.part_free[node.name, g.index] = g.memory_mib - used
        for name, gpus in self.whole.items():  # the fault-free whole GPUs first (most nodes have no faults)
            gpus.sort(key=(lambda g: (len(faults.get(g.uuid, ())), g.index)) if name in self.node_faults
                      else attrgetter("index"))
        self.part.sort()
        # How good a node's whole GPUs are to take one from: fewer recent faults, then fewest free (best fit);
        # a closure over locals, asked once per node per placement.
        whole, nf = self.whole, self.node_faults.get
        self.whole_key: Callable[[str], tuple[int | str, ...]] = (
            (lambda n: (nf(n, 0), len(whole[n]), n)) if self.node_faults else (lambda n: (len(whole[n]), n)))

    def take(self, gpu: GpuView, was_free: int | None, mib: int) -> None:
        """``mib`` booked on ``gpu`` (``was_free``: its free MiB when partly booked, None when whole)."""
        if was_free is None:
            left = [g for g in self.whole[gpu.node] if g.index != gpu.index]
            if left:
                self.whole[gpu.node] = left
            else:
                del self.whole[gpu.node]
            free = gpu.memory_mib - mib
        else:
            del self.part[bisect.bisect_left(self.part, (was_free, gpu.node, gpu.index))]
            free = was_free - mib
        if free > 0:
            bisect.insort(self.part, (free, gpu.node, gpu.index))
            self.part_free[gpu.node, gpu.index] = free
        else:
            self.part_free.pop((gpu.node, gpu.index), None)

    def most_free(self) -> tuple[int, str, int] | None:
        """The partly booked GPU with the most free MiB, or None."""
        return self.part[-1] if self.part else None


Where = tuple[tuple[str, ...], tuple[m.GpuRef, ...], str]


def place(state: FleetState, spec: m.ModelSpec, room: Room,
          avoid: set[str] | frozenset[str] = frozenset(), held: set[str] | frozenset[str] = frozenset()) -> Where | None:
    """Nodes, GPUs (each with the MiB booked on it) and fabric for one replica of ``spec``, or None.

    Best fit. A replica that shares goes to the partly booked GPU it leaves the least room on,
    before an empty GPU, so whole cards stay free for models that need them; an empty one comes
    from the node (or fabric) with the fewest free GPUs that still fits, so large holes stay open.
    Nodes in ``avoid`` (already serving this model) come last, so one lost node does not take
    every replica. Nodes in ``held`` (their disks hold the spec's files) come before the others,
    after ``avoid``. The chosen GPUs are taken out of ``room``.
    """
    if not spec.exclusive and spec.tp == 1 and spec.pp == 1:
        if held and (where := _place_small_on(state, spec, room, held - avoid)) is not None:
            return where
        where = _place_small(state, spec, room, avoid)
    else:
        where = _place_split(state, spec, room, avoid, held)
    return where


def _gpu(state: FleetState, node: str, index: int) -> GpuView:
    return state.nodes[node].gpus[index]


def _place_small_on(state: FleetState, spec: m.ModelSpec, room: Room, nodes: set[str] | frozenset[str]) -> Where | None:
    """Best fit on these nodes only: the tightest partly booked GPU there, else the fullest node's empty one."""
    if not nodes:
        return None
    # A few nodes: their GPUs looked at directly, never a walk over the fleet's partly booked ones.
    fits = [(free, node, g.index) for node in sorted(nodes) for g in state.nodes[node].gpus.values()
            if (free := room.part_free.get((node, g.index), 0)) and booking_mib(spec, g.memory_mib) <= free]
    if fits:
        free, node, index = min(fits)
        return _took(state, spec, room, [(_gpu(state, node, index), free)])
    whole = [n for n in nodes if n in room.whole]
    if whole:
        best = min(whole, key=room.whole_key)
        return _took(state, spec, room, [(room.whole[best][0], None)])
    return None


def _place_small(state: FleetState, spec: m.ModelSpec, room: Room, avoid: set[str] | frozenset[str]) -> Where | None:
    need = booking_mib(spec, room.card_mib) if room.card_mib else 1
    avoided: tuple[int, str, int] | None = None
    for entry in room.part[bisect.bisect_left(room.part, (need, "", -1)):]:
        free, node, index = entry
        gpu = _gpu(state, node, index)
        if booking_mib(spec, gpu.memory_mib) > free:
            continue
        if node not in avoid:
            return _took(state, spec, room, [(gpu, free)])
        avoided = avoided or entry
    whole = [n for n in room.whole if n not in avoid] or ([] if avoided else list(room.whole))
    if whole:
        best = min(whole, key=room.whole_key)
        return _took(state, spec, room, [(room.whole[best][0], None)])
    if avoided is not None:
        return _took(state, spec, room, [(_gpu(state, avoided[1], avoided[2]), avoided[0])])
    return None


def _place_split(state: FleetState, spec: m.ModelSpec, room: Room, avoid: set[str] | frozenset[str],
                 held: set[str] | frozenset[str] = frozenset()) -> Where | None:
    # Only the partly booked GPUs a rank fits on (the bisection skips those with too little free),
    # and a node's key from counts: the GPU lists are built for the chosen nodes alone.
    part_by_node: dict[str, list[tuple[int, int]]] = {}
    if not spec.exclusive:
        need = booking_mib(spec, room.card_mib) if room.card_mib else 1
        for free, node, index in room.part[bisect.bisect_left(room.part, (need, "", -1)):]:
            if booking_mib(spec, _gpu(state, node, index).memory_mib) <= free:
                part_by_node.setdefault(node, []).append((free, index))
    whole, node_faults = room.whole, room.node_faults
    tp = spec.tp
    if part_by_node:
        options = [n for n in whole.keys() | part_by_node.keys()
                   if len(whole.get(n, ())) + len(part_by_node.get(n, ())) >= tp]

        def key(n: str) -> tuple[bool, bool, int, int, int, str]:
            # Holding its files, fewer recent faults, fewest whole GPUs broken into, fewest free left (best fit).
            return (n in avoid, n not in held, node_faults.get(n, 0), max(0, tp - len(part_by_node.get(n, ()))),
                    len(whole.get(n, ())), n)
    else:  # whole GPUs only (exclusive, or nothing partly booked fits): every option breaks tp of them
        options = [n for n, gpus in whole.items() if len(gpus) >= tp]

        def key(n: str) -> tuple[bool, bool, int, int, int, str]:
            return n in avoid, n not in held, node_faults.get(n, 0), tp, len(whole[n]), n

    def fits(n: str) -> list[tuple[GpuView, int | None]]:
        out: list[tuple[GpuView, int | None]] = [(_gpu(state, n, i), free) for free, i in sorted(part_by_node.get(n, ()))]
        if len(out) < tp:  # whole GPUs fewest faults first (``Room``), taken in index order
            out += [(g, None) for g in sorted(whole.get(n, ())[: tp - len(out)], key=lambda g: g.index)]
        return out[:tp]

    if spec.pp <= 1:
        if not options:
            return None
        return _took(state, spec, room, fits(min(options, key=key)))
    choices = []
    for fabric, group in by_fabric(sorted(options), lambda n: state.nodes[n].fabric).items():
        if len(group) < spec.pp:
            continue
        chosen = sorted(group, key=key)[: spec.pp]
        choices.append((sum(n not in held for n in chosen), sum(len(whole.get(n, ())) for n in chosen), fabric, chosen))
    if not choices:
        return None
    _, _, fabric, chosen = min(choices)
    return _took(state, spec, room, [g for n in chosen for g in fits(n)], fabric)


def _took(state: FleetState, spec: m.ModelSpec, room: Room, gpus: list[tuple[GpuView, int | None]],
          fabric: str | None = None) -> Where:
    refs = []
    nodes: list[str] = []
    for gpu, was_free in gpus:
        mib = booking_mib(spec, gpu.memory_mib)
        room.take(gpu, was_free, mib)
        refs.append(m.GpuRef(node=gpu.node, index=gpu.index, uuid=gpu.uuid, mib=mib))
        if gpu.node not in nodes:
            nodes.append(gpu.node)
    return tuple(nodes), tuple(refs), state.nodes[nodes[0]].fabric if fabric is None else fabric


def class_fabrics(state: FleetState, cls: str) -> dict[str, list[NodeView]]:
    """The nodes with GPUs of a class, by fabric."""
    return by_fabric((n for n in state.nodes.values() if any(g.gpu_class == cls for g in n.gpus.values())),
                     lambda n: n.fabric)


def _gib(mib: int) -> str:
    return f"{mib / 1024:.1f}"


def unplaceable_reason(state: FleetState, spec: m.ModelSpec, room: Room,
                       fabrics: dict[str, list[NodeView]] | None = None) -> str:
    """Why a replica does not fit, with what each fabric has free, and what to do next.

    ``room`` is the class's room as the pass keeps it, and ``fabrics`` its nodes by fabric
    (``class_fabrics``) when the caller has them. A replica that shares a card is told the GiB
    it needs and the most any one GPU has free.
    """
    cls = spec.gpu_class
    need_mib = booking_mib(spec, room.card_mib) if room.card_mib else 0
    shares = not spec.exclusive and room.card_mib and need_mib < room.card_mib
    each = f" ({_gib(need_mib)} GiB on each GPU)" if shares else ""
    if spec.pp <= 1:
        need = f"needs {spec.tp} × {cls} on one node{each}"
    else:
        need = f"needs {spec.pp} nodes with {spec.tp} × {cls} each, in one fabric{each}"
    fabrics = class_fabrics(state, cls) if fabrics is None else fabrics
    if not fabrics:
        classes = sorted({g.gpu_class for g in state.gpus()})
        have = ", ".join(classes) if classes else "none reported yet"
        return f"{need}; no node has {cls} GPUs (classes in the fleet: {have}); deploy with another --gpu-class"
    free = room.whole
    parts = []
    for fabric in sorted(fabrics):
        nodes = sorted(n.name for n in fabrics[fabric] if n.name in free)
        if not nodes:
            lost = sum(1 for n in fabrics[fabric] if n.lost)
            extra = f" ({lost} node{'s' if lost != 1 else ''} lost)" if lost else ""
            parts.append(f"fabric {fabric} has none free{extra}")
        else:
            first, *rest = nodes
            tail = "".join(f", {len(free[n])} on {n}" for n in rest)
            parts.append(f"fabric {fabric} has {len(free[first])} free on {first}{tail}")
    if shares and spec.tp * spec.pp == 1 and (best := room.most_free()) is not None:
        free_mib, node, index = best
        parts.append(f"the most free on one GPU is {_gib(free_mib)} GiB (GPU {index} on {node}), "
                     f"{_gib(need_mib - free_mib)} GiB short")
    return f"{need}; " + "; ".join(parts) + "; free cards with `llmgw ctl idle --stop` or choose a smaller plan candidate"


def same_run(a: m.ModelSpec, b: m.ModelSpec) -> bool:
    """Whether a replica of spec ``a`` runs what ``b`` declares: how many, and when to stop, aside."""
    return _run_part(a) == _run_part(b)


def _run_part(spec: m.ModelSpec) -> m.ModelSpec:
    # kv_tokens is the plan's figure (or what an engine reserved), not something the engine runs with;
    # routing is the routers' business: changing it restarts no engine.
    # how a change rolls is the scheduler's business: changing it restarts nothing either.
    return msgspec.structs.replace(spec, replicas=0, idle_ttl_s=None, min_replicas=None, max_replicas=None,
                                   target_in_flight=1.0, kv_tokens=0, routing="prefix", roll="surge")


def _recommend(spec: m.ModelSpec, demand: int) -> int:
    """Replicas for this demand: one per ``target_in_flight`` requests, within the bounds."""
    assert spec.min_replicas is not None and spec.max_replicas is not None
    return min(max(math.ceil(demand / spec.target_in_flight), spec.min_replicas), spec.max_replicas)


def autoscale(state: FleetState, memory: SchedulerMemory, now: datetime) -> list[tuple[m.ModelAutoscaled, str]]:
    """The autoscaler's changes (with their ids): wake on a wish, then up or down with the load.

    A model scaled to zero wakes when a router wanted it after seeing that
    scale (its control sequence is at or after it). Up needs every map of the
    last UP_SAMPLES router ticks to ask for more, down every map of the last
    DOWN_SAMPLES ticks to ask for fewer: the long window down is the hysteresis.
    Ticks of time, not maps: five routers publish five maps a tick.
    """
    out = []
    for name in sorted(state.models):
        model = state.models[name]
        spec = model.spec
        if not spec.autoscaled or (model.replicas_wanted == 0 and model.replicas_by == "operator"):
            continue  # an operator's 0 is "off" until they scale again
        assert spec.min_replicas is not None
        current = model.replicas_wanted
        new, reason, code = current, "", ""
        wish = memory.wished.get(name)
        zeroed = memory.zeroed_at.get(name)
        # Only maps from routers that had seen the count's last change: the stabilization
        # windows start again at every change, and the comparison of sequences does not
        # depend on how the usage and control streams interleave.
        since = memory.count_changed_at.get(name, 0)
        window = memory.windows.get(name, [])
        ups = agreeing(window, since, UP_SAMPLES) if window else None
        downs = agreeing(window, since, DOWN_SAMPLES) if window else None
        tick = window[-1][3] if window else 0.0
        if current == 0 and zeroed is not None and wish is not None and wish.control_seq >= zeroed:
            new, code = max(spec.min_replicas, 1), "woken"
            reason = f"woken by {wish.router}: {wish.waiting} request{'s' if wish.waiting != 1 else ''} waiting"
        elif ups and (up := min(_recommend(spec, x) for x in ups)) > current:
            new, code = up, "scaled_up"
            per = ups[-1] / max(current, 1)
            reason = (f"scaled up: {per:.1f} in flight per replica > {spec.target_in_flight:g} "
                      f"for {UP_SAMPLES} router ticks ({UP_SAMPLES * tick:g}s)")
        elif downs and (down := max(_recommend(spec, x) for x in downs)) < current:
            new, code = down, "scaled_down"
            per = max(downs) / max(current, 1)
            reason = (f"scaled down: at most {per:.1f} in flight per replica < {spec.target_in_flight:g} "
                      f"for {DOWN_SAMPLES} router ticks ({DOWN_SAMPLES * tick:g}s)")
        elif not spec.min_replicas <= current <= (spec.max_replicas or current):
            new, code = min(max(current, spec.min_replicas), spec.max_replicas or current), "bounds"
            reason = f"kept within min {spec.min_replicas} and max {spec.max_replicas}"
        if new != current:
            event = m.ModelAutoscaled(at=now, name=name, replicas=new, reason=reason, code=code)
            out.append((event, f"ModelAutoscaled:{name}:{memory.autoscalings.get(name, 0)}:{new}:{_key(model.declared_at)}"))
    return out


def _key(*parts: object) -> str:
    return hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=12).hexdigest()


def decide(state: FleetState, memory: SchedulerMemory, now: datetime,
           quarantine: Quarantine = QUARANTINE) -> list[Decision]:
    """Everything to publish now so that the fleet converges on what was declared (``quarantine``: how
    many GPU faults in how long take a node out of placement, ``maintenance.quarantines``)."""
    out: list[Decision] = []
    # The autoscaler's changes count at once, so a wake places in the same pass.
    target: dict[str, int] = {}
    why: dict[str, str] = {}
    cause: dict[str, str] = {}  # the ledger's code for the placements an autoscale causes
    out += [Decision(event, msg_id) for event, msg_id in quarantines(state, now, quarantine)]
    cordoned = set(state.cordoned) | {d.event.node for d in out if isinstance(d.event, m.NodeCordoned)}
    for event_a, msg_id in autoscale(state, memory, now):
        out.append(Decision(event_a, msg_id))
        target[event_a.name] = event_a.replicas
        if event_a.replicas > (before := state.models[event_a.name].replicas_wanted):
            why[event_a.name] = event_a.reason
            cause[event_a.name] = "wake" if before == 0 else "scale-up"
    booked = state.booked()
    live: dict[str, list[ReplicaView]] = defaultdict(list)
    # Stops decided in this pass count as if already folded: an idle stop parks
    # the replica and a failure starts the back-off now, not one pass later.
    parked_now: dict[str, int] = defaultdict(int)
    failed_now: set[str] = set()

    # What each class has free, computed once and kept current: recomputing it for
    # every replica made a first pass over 4000 GPUs take seconds.
    room_by_class: dict[str, Room] = {}
    files_by_source = by_source(state.files) if state.files else {}  # once a pass: holders by source
    fabrics_by_class: dict[str, dict[str, list[NodeView]]] = {}  # for the reasons; GPUs held change nothing in it
    stopped_models: set[str] = set()

    def room_for(cls: str) -> Room:
        if cls not in room_by_class:
            room_by_class[cls] = Room(state, booked, cls, cordoned)
        return room_by_class[cls]

    def stop(replica: ReplicaView, code: str, reason: str) -> None:
        event = m.ReplicaStopped(at=now, replica_id=replica.replica_id, model=replica.model, reason=reason, code=code)
        out.append(Decision(event, f"ReplicaStopped:{replica.replica_id}"))
        for g in replica.gpus:
            key = (g.node, g.index)
            if (left := booked.get(key, 0) - state.ref_mib(g)) > 0:
                booked[key] = left
            else:
                booked.pop(key, None)
        room_by_class.pop(replica.spec.gpu_class, None)
        stopped_models.add(replica.model)

    for replica in sorted(state.replicas.values(), key=lambda r: (r.placed_at, r.replica_id)):
        model = state.models.get(replica.model)
        if model is None:
            stop(replica, "removed", "model removed")
            continue
        if (lost := _lost_reason(state, replica)) is not None:
            stop(replica, lost[0], f"re-placing: {lost[1]}")
            continue
        if replica.state == "failed":
            stop(replica, "engine_failed", f"failed: {replica.detail or 'the engine did not start'}")
            failed_now.add(replica.model)
            continue
        ttl = model.spec.idle_ttl_s
        if ttl is not None and ttl > 0:
            idle = state.idle_s(replica.replica_id, now)  # the control plane's gaps left out: nobody could ask
            # Unknown idle time is never idle: without a router's word, nothing is stopped.
            if idle is not None and idle >= ttl:
                stop(replica, "idle", f"idle: no request for {idle:.0f}s (idle_ttl {ttl:g}s)")
                parked_now[replica.model] += 1
                continue
        live[replica.model].append(replica)

    for name in sorted(state.models):
        model = state.models[name]
        spec = model.spec
        running = live.get(name, [])
        replicas_wanted = target.get(name, model.replicas_wanted)
        wanted = max(replicas_wanted - memory.parked(name) - parked_now[name], 0)
        by_age = sorted(running, key=lambda r: (r.placed_at, r.replica_id))
        # A replica on a draining node is replaced as one of an old spec is: a new one elsewhere first.
        current = [r for r in by_age if same_run(r.spec, spec) and not _draining(state, r)]
        outdated = [r for r in by_age if not same_run(r.spec, spec) or _draining(state, r)]
        if len(current) > wanted:
            def scale_stop(r: ReplicaView, n: int = replicas_wanted) -> None:
                stop(r, "scaled_down", f"scaled down to {n}")

            current = _scale_down(state, memory, current, len(current) - wanted, scale_stop)
        # A re-declared spec rolls: an old replica stops only once a new one is
        # healthy in its place, so a redeploy never takes a model offline.
        healthy_new = sum(1 for r in current if r.state == "healthy")
        retire = max(len(outdated) - max(wanted - healthy_new, 0), 0)
        for replica in outdated[:retire]:
            if same_run(replica.spec, spec):  # it is on a draining node
                stop(replica, "drained", f"draining {', '.join(replica.nodes)}: replaced by a replica elsewhere")
            else:
                stop(replica, "spec_changed", "spec changed: replaced by a replica of the new spec")
        outdated = outdated[retire:]
        running = current + outdated
        missing = wanted - len(current)
        if missing <= 0:
            continue
        if name in failed_now:
            continue
        failures = memory.failures.get(name, 0)
        failed_at = memory.failed_at.get(name)
        if failures and failed_at is not None and now < failed_at + timedelta(seconds=backoff_s(failures)):
            continue  # backing off: a replica that keeps failing must not loop hot
        n = memory.placed.get(name, 0)
        avoid = {node for r in running for node in r.nodes}
        # Which nodes hold its files, only where any node reported its disk: a fleet without file
        # reports (simulated agents) places exactly as before.
        held = holders_of(files_by_source, spec) if files_by_source else set()
        placed_now = 0
        for _ in range(missing):
            where = place(state, spec, room_for(spec.gpu_class), avoid, held)
            if where is None:
                break
            nodes, gpus, fabric = where
            n += 1
            rid = replica_id(name, n)
            woken = "" if name in why else _woken(memory, name, running)
            reason = why.get(name) or woken or f"{len(running) + placed_now} of {wanted} running"
            if files_by_source and not set(nodes) <= held:
                reason += "; " + _download_note(files_by_source, spec, held, avoid)
            event = m.ReplicaPlaced(
                at=now, replica_id=rid, model=name, nodes=nodes, gpus=gpus, spec=spec, fabric=fabric, reason=reason,
                cause=cause.get(name, "wake" if woken else ""),
            )
            out.append(Decision(event, f"ReplicaPlaced:{rid}"))
            for g in gpus:
                booked[(g.node, g.index)] = booked.get((g.node, g.index), 0) + g.mib
            avoid.update(nodes)
            placed_now += 1
        if placed_now < missing and outdated and name not in stopped_models and spec.roll == "in-place":
            # No room to surge, and the operator chose downtime over waiting: free the oldest replica of
            # the old spec; the next pass places the new one.
            stop(outdated[0], "spec_changed", "spec changed: stopped to make room for the new spec (roll in-place)")
            continue
        if placed_now < missing and state.nodes:
            # With no node reported yet (a scheduler starting before its agents) there is nothing to explain.
            # The pass's own free map: recomputing it for every short model made a replay of a
            # week with unplaceable models spend most of its time here.
            cls = spec.gpu_class
            if cls not in fabrics_by_class:
                fabrics_by_class[cls] = class_fabrics(state, cls)
            reason = unplaceable_reason(state, spec, room_for(cls), fabrics_by_class[cls])
            if held:
                reason += (f"; its files are on {len(held)} node{'s' if len(held) != 1 else ''} "
                           f"({', '.join(sorted(held)[:4])}), none with room for it")
            if outdated:  # a roll waiting for room: the old spec serves meanwhile (roll "surge")
                reason = (f"spec changed, and no room for a replica of the new spec beside the old: {reason}; "
                          f"{len(outdated)} replica{'s' if len(outdated) != 1 else ''} of the old spec keep serving "
                          "until there is; or redeploy with --roll in-place, which stops one first (the model then "
                          "serves nothing until the new one is healthy)")
            if reason != model.unplaceable_reason:
                short = missing - placed_now
                code = "no_room" if fabrics_by_class[cls] else "no_such_class"  # some node has the class, or none
                event_u = m.ModelUnplaceable(at=now, name=name, reason=reason, missing_replicas=short, code=code)
                # The count's last change is in the id: a scale clears "unplaceable" in the fold, and the
                # same reason said again after it must be stored, not dropped as a duplicate of the first.
                key = _key(reason, model.declared_at, memory.count_changed_at.get(name, 0))
                out.append(Decision(event_u, f"ModelUnplaceable:{name}:{n}:{key}"))
    return out


def _draining(state: FleetState, replica: ReplicaView) -> bool:
    return any((c := state.cordoned.get(n)) is not None and c.drain for n in replica.nodes)


def _scale_down(state: FleetState, memory: SchedulerMemory, current: list[ReplicaView], extra: int,
                stop: Callable[[ReplicaView], None]) -> list[ReplicaView]:
    """Stop ``extra`` replicas, those nobody is using first; never one with a request in flight.

    Not yet healthy first (nothing to lose), then the longest idle; a replica
    any router reports busy stays until a later pass finds it idle. Returns
    the replicas that keep running, oldest first.
    """
    far = datetime.max.replace(tzinfo=UTC)

    def key(r: ReplicaView) -> tuple[bool, datetime, float, str]:
        return r.state == "healthy", state.idle_since(r.replica_id) or far, -r.placed_at.timestamp(), r.replica_id

    stopped: set[str] = set()
    for r in sorted(current, key=key):
        if len(stopped) == extra:
            break
        if memory.busy(r.replica_id):
            continue
        stop(r)
        stopped.add(r.replica_id)
    return [r for r in current if r.replica_id not in stopped]


def _woken(memory: SchedulerMemory, name: str, running: list[ReplicaView]) -> str:
    """"woken by <router>" when nothing runs and a router wanted the model after its last idle stop."""
    wish, stop = memory.wished.get(name), memory.last_idle_stop.get(name)
    if running or wish is None or stop is None or wish.control_seq < stop:
        return ""
    return f"woken by {wish.router}: {wish.waiting} request{'s' if wish.waiting != 1 else ''} waiting"


def _download_note(files_by_source: dict[str, list[tuple[str, list[m.HeldSource]]]], spec: m.ModelSpec,
                   held: set[str], avoid: set[str]) -> str:
    """What a placement on a node without the spec's files costs, and why not a holder, for its reason."""
    size = expected_bytes_of(files_by_source, spec)
    dl = f"downloads {gib(size)} first" if size else "downloads them first"
    if not held:
        return f"its files are on no node: {dl}"
    why = ("each already serves it" if held <= avoid else "serving it or full" if held & avoid else "no room there")
    return f"its files are only on {', '.join(sorted(held)[:4])} ({why}): {dl}"
