"""The fleet status report: one pure function of a FleetState, ``now`` and an idle threshold.

The live projector, ``ctl status --replay`` and a projector resumed after a
crash all call ``report`` on the state they folded, so they cannot disagree.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import msgspec

from llmgw import messages as m
from llmgw.fleet.files import holders as file_holders
from llmgw.fleet.history import ModelHistory, error_line, split_by_day
from llmgw.fleet.history import failed as failed_report
from llmgw.fleet.observed import compared
from llmgw.fleet.state import Cursor, FleetState, ReplicaView, plane_gap

UNKNOWN_IDLE = -1.0  # JSON for "no router knows": never a duration anything could act on


def _utc(t: datetime | None) -> datetime | None:
    return t.astimezone(UTC) if t is not None else None


def capacity(state: FleetState, held: dict[tuple[str, int], str]) -> tuple[m.ClassCapacity, ...]:
    """Per GPU class: total, used, free, unhealthy, lost (whole GPUs; unhealthy is neither used nor free),
    and the memory of its usable GPUs: booked, left (summed, and the most on one GPU), and what engines report."""
    counts: dict[str, list[int]] = {}
    memory: dict[str, list[int]] = {}  # class → [memory, booked, free, most free on one GPU]
    booked = state.booked()
    usable: dict[tuple[str, int], str] = {}  # (node, index) → class, of the healthy GPUs of live nodes
    for node in state.nodes.values():
        for gpu in node.gpus.values():
            c = counts.setdefault(gpu.gpu_class, [0, 0, 0, 0, 0])
            mem = memory.setdefault(gpu.gpu_class, [0, 0, 0, 0])
            c[0] += 1
            if node.lost:
                c[4] += 1
                continue
            if not gpu.healthy:
                c[3] += 1
                continue
            c[1 if (node.name, gpu.index) in held else 2] += 1
            usable[(node.name, gpu.index)] = gpu.gpu_class
            on = booked.get((node.name, gpu.index), 0)
            left = max(0, gpu.memory_mib - on)
            mem[0] += gpu.memory_mib
            mem[1] += on
            mem[2] += left
            mem[3] = max(mem[3], left)
    used: dict[str, int] = {}
    for r in state.replicas.values():
        for name, mib in r.observed_memory_mib.items():
            # What its engine holds on a node, under the class of its usable GPUs there.
            cls = next((usable[(g.node, g.index)] for g in r.gpus if g.node == name and (g.node, g.index) in usable),
                       None)
            if cls is not None:
                used[cls] = used.get(cls, 0) + mib
    return tuple(
        m.ClassCapacity(gpu_class=k, total=c[0], used=c[1], free=c[2], unhealthy=c[3], lost=c[4],
                        memory_mib=memory[k][0], booked_mib=memory[k][1], free_mib=memory[k][2],
                        most_free_mib=memory[k][3], used_mib=used.get(k))
        for k, c in sorted(counts.items())
    )


def free_nodes(state: FleetState, held: dict[tuple[str, int], str]) -> tuple[m.FabricNodes, ...]:
    """Whole free nodes per (fabric, class): what decides whether a multi-node replica lands."""
    live: Counter[tuple[str, str]] = Counter()
    free: Counter[tuple[str, str]] = Counter()
    for node in state.nodes.values():
        if not node.gpus:
            continue
        classes = {g.gpu_class for g in node.gpus.values()}
        key = (node.fabric, classes.pop() if len(classes) == 1 else "mixed")
        live[key] += 0  # a fabric whose nodes are all lost still shows, with 0
        if node.lost:
            continue
        live[key] += 1
        if len(state.free_gpus(node, held)) == len(node.gpus):
            free[key] += 1
    return tuple(
        m.FabricNodes(fabric=f, gpu_class=c, free_nodes=free[(f, c)], live_nodes=n)
        for (f, c), n in sorted(live.items())
    )


@dataclass(frozen=True)
class IdleRow:
    """One replica and how long nobody has asked for it (None: no router knows; never idle)."""

    replica_id: str
    model: str
    nodes: tuple[str, ...]
    gpus: int
    state: str
    idle_s: float | None
    idle_since: datetime | None
    age_s: float | None = None  # since it was placed (None: no clock to judge by)

    @property
    def gpu_hours_idle(self) -> float:
        return self.gpus * self.idle_s / 3600 if self.idle_s is not None else 0.0


def idle_rows(state: FleetState, now: datetime | None) -> list[IdleRow]:
    """Every replica and its idle time: the most GPU-time idle first, those nobody knows about last.

    The one idle answer: ``ctl status`` and ``ctl idle`` both read it.
    """
    rows = []
    for r in state.replicas.values():
        since = state.idle_since(r.replica_id) if now is not None else None
        idle = state.idle_s(r.replica_id, now) if since is not None and now is not None else None
        age = max(0.0, (now - r.placed_at).total_seconds()) if now is not None else None
        rows.append(IdleRow(r.replica_id, r.model, r.nodes, len(r.gpus), r.state, idle, since, age))
    return sorted(rows, key=lambda x: (x.idle_s is None, -x.gpus * (1.0 if x.idle_s is None else x.idle_s), x.replica_id))


def nobody_asked(row: IdleRow, threshold_s: float) -> bool:
    """Whether a replica belongs under "nobody asked for": idle at least ``threshold_s``, or unknown to every
    router for as long as that (a replica placed a minute ago, still starting, could not have been asked)."""
    if row.idle_s is None:
        return row.age_s is None or row.age_s >= threshold_s
    return row.idle_s >= threshold_s


def idle_replicas(state: FleetState, now: datetime | None, threshold_s: float) -> tuple[list[m.IdleReplica], int]:
    """The status report's idle list: idle past the threshold, then those nobody knows about (-1 on the wire)."""
    views = state.replicas
    out = [m.IdleReplica(replica_id=r.replica_id, model=r.model, gpus=r.gpus, nodes=r.nodes, state=r.state,
                         idle_s=UNKNOWN_IDLE if r.idle_s is None else r.idle_s,
                         idle_since=None if r.idle_s is None else _utc(r.idle_since),
                         prompt_tokens=v.prompt_tokens if (v := views.get(r.replica_id)) else 0,
                         cached_tokens=v.cached_tokens if v else 0)
           for r in idle_rows(state, now) if nobody_asked(r, threshold_s)]
    return out, sum(r.idle_s < 0 for r in out)


def _idle(state: FleetState, replica_id: str, now: datetime | None) -> tuple[float | None, datetime | None]:
    """How long nobody has asked for a replica, and since when; (None, None) when no router knows."""
    since = state.idle_since(replica_id) if now is not None else None
    if since is None or now is None:
        return None, None
    return state.idle_s(replica_id, now), since


def replica_rows(state: FleetState, now: datetime | None, model: str | None = None) -> tuple[m.ReplicaRow, ...]:
    """Every replica (or ``model``'s), by model and id: where it runs, how it is doing, its idle time and KV cache."""
    rows = []
    for r in sorted(state.replicas.values(), key=lambda r: (r.model, r.replica_id)):
        if model is not None and r.model != model:
            continue
        idle, since = _idle(state, r.replica_id, now)
        planned, observed = r.spec.kv_tokens_planned, r.observed_kv_tokens
        # The head reports what its engine reserved; against the plan only where its card sized it.
        against = compared(r.spec, state.nodes.get(r.nodes[0]))
        rows.append(m.ReplicaRow(
            replica_id=r.replica_id, model=r.model, state=r.state, nodes=r.nodes, gpus=r.gpus, fabric=r.fabric,
            endpoint=r.endpoint, restarts=r.restarts, detail=r.detail, placed_at=_utc(r.placed_at),
            state_at=_utc(r.state_at), idle_s=UNKNOWN_IDLE if idle is None else idle, idle_since=_utc(since),
            kv_tokens_planned=planned, kv_tokens_observed=observed,
            kv_error=round((planned - observed) / observed, 4) if planned and observed and against else None,
            observed_memory_mib=dict(sorted(r.observed_memory_mib.items())),
            booked_mib=_booked_by_node(state, r), overbooked=r.overbooked,
            prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
        ))
    return tuple(rows)


def _booked_by_node(state: FleetState, r: ReplicaView) -> dict[str, int]:
    """MiB a replica booked on each of its nodes, over its GPUs there (the whole card where it booked that)."""
    out: dict[str, int] = {}
    for g in r.gpus:
        out[g.node] = out.get(g.node, 0) + state.ref_mib(g)
    return dict(sorted(out.items()))


def gpu_hours_today(name: str, replicas: list[ReplicaView], now: datetime | None,
                    history: ModelHistory | None, down_since: datetime | None = None) -> float:
    """GPU-hours a model's replicas held on ``now``'s UTC day: those running now, and those stopped (``history``);
    none while the control plane was down (the history's gaps; ``down_since``: it is down now)."""
    if now is None:
        return 0.0
    day = now.astimezone(UTC).date()
    seconds = history.gpu_seconds_stopped(name, day) if history is not None else 0.0
    end = now if down_since is None else min(now, down_since)
    for r in replicas:
        since = (history.held_since(r.replica_id) if history is not None else None) or r.placed_at
        seconds += len(r.gpus) * sum(s for d, s in split_by_day(since, end) if d == day)
    return round(seconds / 3600, 3)


def plane_down(state: FleetState, now: datetime | None,
               next_start: m.ControlPlaneStarted | None = None) -> datetime | None:
    """Since when the control plane is down at ``now``, or None: its recorded stop, or, for a moment a later
    start says it was not seen alive since (a kill -9: ``next_start``, the first control-plane event stored
    after the fold's end when that is a start), the time it was last seen."""
    if state.plane_down_since is not None:
        return state.plane_down_since
    if next_start is None or next_start.last_seen is None or now is None:
        return None
    gap = plane_gap(None, state.plane_started_at, next_start)
    return gap[0] if gap is not None and gap[0] <= now < gap[1] else None


def _down(summary: m.ModelSummary) -> m.ModelSummary:
    return msgspec.structs.replace(summary, state="down", healthy=0)


def kv_observed(state: FleetState, spec: m.ModelSpec, replicas: list[ReplicaView], history: ModelHistory | None) -> int:
    """What a model's engines last reported reserving, where it stands against the plan (``observed.compared``):
    the latest report, which stays when its replica stops (a parked model keeps what it learnt); 0: none."""
    if history is None:
        return max((r.observed_kv_tokens for r in replicas if compared(r.spec, state.nodes.get(r.nodes[0]))), default=0)
    tokens = history.observed_kv.get(spec.name, 0)
    node = history.observed_on.get(spec.name)
    return tokens if tokens and compared(spec, state.nodes.get(node) if node else None) else 0


def model_summaries(state: FleetState, now: datetime | None, history: ModelHistory | None = None,
                    down_since: datetime | None = None) -> tuple[m.ModelSummary, ...]:
    """Every declared model at a glance, by name: ``ctl model list``; ``down_since``: the control plane is
    down, so none serves (state "down", none healthy) and none holds GPUs since."""
    states = state.model_states(history.failure if history is not None else ())
    by_model: dict[str, list[ReplicaView]] = {}
    for r in state.replicas.values():
        by_model.setdefault(r.model, []).append(r)
    out = []
    for name in sorted(state.models):
        v, reps = state.models[name], by_model.get(name, [])
        spec = v.spec
        idles = [_idle(state, r.replica_id, now) for r in reps]
        # The model is idle as long as its least idle replica; one no router knows could have been asked.
        known = bool(idles) and all(i is not None for i, _ in idles)
        idle, since = min(idles, key=lambda x: x[0] or 0.0) if known else (None, None)
        failure, failure_at = _failure(name, reps, history) if states[name] == "failing" else (None, None)
        out.append(m.ModelSummary(
            name=name, state=states[name], healthy=sum(r.state == "healthy" for r in reps), placed=len(reps),
            wanted=v.replicas_wanted, set_by=v.replicas_by, min_replicas=spec.min_replicas,
            max_replicas=spec.max_replicas, target_in_flight=spec.target_in_flight if spec.autoscaled else None,
            idle_ttl_s=spec.idle_ttl_s, source=spec.source, precision=spec.precision, engine=spec.engine,
            quantization=spec.quantization, gpu_class=spec.gpu_class, tp=spec.tp, pp=spec.pp,
            gpus_per_replica=spec.tp * spec.pp, context=spec.context, unplaceable=v.unplaceable_reason,
            kv_tokens_planned=spec.kv_tokens_planned,
            kv_tokens_observed=kv_observed(state, spec, reps, history),
            unplaceable_since=_utc(v.unplaceable_at), declared_at=_utc(v.declared_at),
            gpus_held=sum(len(r.gpus) for r in reps), idle_s=UNKNOWN_IDLE if idle is None else idle,
            idle_since=_utc(since), gpu_hours_today=gpu_hours_today(name, reps, now, history, down_since),
            failure=failure, failure_at=_utc(failure_at),
            files_nodes=len(file_holders(state.files, spec)) if state.files else -1,
            fetching=tuple(m.FileFetch(node=node, done=d.done, total=d.total, rate=d.rate, at=_utc(d.at))
                           for node, on in sorted(state.downloads.items()) for src, d in on.items()
                           if src == spec.source and d.model == name),
        ))
    return tuple(map(_down, out)) if down_since is not None else tuple(out)


def _failure(name: str, replicas: list[ReplicaView], history: ModelHistory | None) -> tuple[str | None, datetime | None]:
    """A failing model's last error line and when: the history's (it outlives a re-placed replica), else its
    replicas' latest failure report."""
    if history is not None and name in history.failure:
        return history.failure[name], history.failure_at.get(name)
    failed = [r for r in replicas if failed_report(r.state, r.restarts) and r.detail]
    latest = max(failed, key=lambda r: r.state_at or datetime.min.replace(tzinfo=UTC), default=None)
    return (error_line(latest.detail), latest.state_at) if latest is not None else (None, None)


def model_detail(state: FleetState, now: datetime | None, name: str, history: ModelHistory | None = None,
                 cursor: Cursor | None = None, down_since: datetime | None = None) -> m.ModelDetail | None:
    """``ctl model show NAME``: None when no model of that name is declared."""
    view = state.models.get(name)
    if view is None:
        return None
    (summary,) = (s for s in model_summaries(state, now, history, down_since) if s.name == name)
    return m.ModelDetail(
        now=_utc(now), positions=dict(sorted((cursor or Cursor()).positions.items())), summary=summary,
        spec=view.spec, replicas=_down_rows(replica_rows(state, now, name), down_since),
        events=history.events(name) if history is not None else (),
        cold_starts=history.cold_starts(name) if history is not None else (),
        cold_start_count=history.start_count.get(name, 0) if history is not None else 0,
    )


def _down_rows(rows: tuple[m.ReplicaRow, ...], down_since: datetime | None) -> tuple[m.ReplicaRow, ...]:
    """While the control plane is down no replica serves: each reads "down", its last report kept in ``detail``."""
    if down_since is None:
        return rows
    return tuple(msgspec.structs.replace(r, state="down", detail=f"was {r.state}" + (f": {r.detail}" if r.detail else ""))
                 for r in rows)


def report(state: FleetState, now: datetime | None = None, idle_threshold_s: float = 1800.0,
           cursor: Cursor | None = None, *, history: ModelHistory | None = None, replicas: bool = False,
           model: str = "", next_start: m.ControlPlaneStarted | None = None) -> m.StatusReport:
    """The status of the fleet at ``now`` (default: the time of the last event folded), read up to ``cursor``.

    ``history`` (the control stream up to the same position) adds what the fold
    forgets: stopped replicas' GPU-hours, and with ``model`` that model's latest events.
    ``next_start``: the first control-plane event stored after the fold's end, when it is a start (a
    moment in the past, ``--at``): it says whether the control plane was down then though nothing recorded it.
    """
    cursor = Cursor() if cursor is None else cursor
    now = state.as_of if now is None else now
    down = plane_down(state, now, next_start)
    held = state.held_gpus()
    # Down since a moment the fold cannot know of (a kill -9's, from the next start): idle stops counting there.
    idle, unknown = idle_replicas(state, now if down is None or now is None else min(now, down), idle_threshold_s)
    unplaceable = tuple(
        m.UnplaceableModel(name=v.spec.name, reason=v.unplaceable_reason, since=_utc(v.unplaceable_at))
        for _, v in sorted(state.models.items())
        if v.unplaceable_reason is not None
    )
    summaries = model_summaries(state, now, history, down)  # model_states says the same: one answer
    return m.StatusReport(
        now=_utc(now),
        idle_threshold_s=float(idle_threshold_s),
        positions=dict(sorted(cursor.positions.items())),
        nodes=len(state.nodes),
        lost_nodes=tuple(sorted(n.name for n in state.nodes.values() if n.lost)),
        capacity=capacity(state, held),
        free_nodes=free_nodes(state, held),
        models=len(state.models),
        replicas=len(state.replicas),
        replicas_by_state=({"down": len(state.replicas)} if down is not None and state.replicas else
                           dict(sorted(Counter(r.state for r in state.replicas.values()).items()))),
        unplaceable=unplaceable,
        idle=tuple(idle),
        unknown_idle=unknown,
        unprojected_events=cursor.unprojected,
        clamped_events=cursor.clamped,
        model_states={s.name: s.state for s in summaries},
        model_list=summaries,
        replica_list=_down_rows(replica_rows(state, now), down) if replicas else (),
        model_detail=model_detail(state, now, model, history, cursor, down) if model else None,
        tenants=tenant_usage(state, now),
        near_limits=keys_near_limits(state, now),
        gpu_bookings=gpu_bookings(state) if replicas else (),
        adapters=adapter_status(state),
        cordoned={n: (("draining" if c.drain else "cordoned") + (f": {c.reason}" if c.reason else "")
                      if c.by == "operator" else c.reason) for n, c in sorted(state.cordoned.items())},
        gpu_faults=node_faults(state, now),
        control_plane="down" if down is not None else ("up" if state.plane_started_at is not None else ""),
        control_plane_since=_utc(down if down is not None else state.plane_started_at),
    )


FAULTS_SHOWN = timedelta(hours=24)  # what ``ctl status`` counts a node's GPU faults over


def node_faults(state: FleetState, now: datetime | None) -> dict[str, int]:
    """Each node whose GPUs went unhealthy in the FAULTS_SHOWN before ``now``: how many times."""
    if not state.faults or (at := now or state.as_of) is None:
        return {}
    since = at - FAULTS_SHOWN
    return {n.name: c for n in sorted(state.nodes.values(), key=lambda n: n.name) if (c := state.node_faults(n, since))}


def adapter_status(state: FleetState) -> tuple[m.AdapterStatus, ...]:
    """Every declared adapter, and the replicas whose engines hold it (``FleetState.adapters_held``)."""
    held: dict[str, list[str]] = {}
    for r in sorted(state.replicas.values(), key=lambda r: r.replica_id):
        for a in state.adapters_held(r):
            held.setdefault(a, []).append(r.replica_id)
    return tuple(m.AdapterStatus(name=a.name, base=a.base, format=a.format, rank=a.rank, size_bytes=a.size_bytes,
                                 held_by=tuple(held.get(a.name, ())), last_request=_utc(state.asked.get(a.name)))
                 for _, a in sorted(state.adapters.items()))


def gpu_bookings(state: FleetState) -> tuple[m.GpuBooking, ...]:
    """Every GPU some replica holds, and who booked how much of it, by node and index."""
    out = []
    for (name, index), holders in sorted(state.gpu_replicas().items()):
        node = state.nodes.get(name)
        gpu = node.gpus.get(index) if node is not None else None
        out.append(m.GpuBooking(node=name, index=index, gpu_class=gpu.gpu_class if gpu else "",
                                memory_mib=gpu.memory_mib if gpu else 0, booked_mib=sum(mib for _, mib in holders),
                                replicas=tuple(holders)))
    return tuple(out)


NEAR_LIMIT = 0.8  # a key at 80 % of its tokens for the day is shown near its limit


def _days(now: datetime | None) -> tuple[str, str]:
    """Today (UTC) and the first day of the seven that end today."""
    at = (now or datetime.now(UTC)).astimezone(UTC)
    return at.strftime("%Y-%m-%d"), (at - timedelta(days=6)).strftime("%Y-%m-%d")


def tenant_usage(state: FleetState, now: datetime | None) -> tuple[m.TenantUsage, ...]:
    """Every tenant's keys summed, today and over the last seven days (revoked keys' use included)."""
    today, first = _days(now)
    sums: dict[str, list[int]] = {}
    for key, days in state.key_usage.items():
        declared = state.keys.get(key)
        row = sums.setdefault(declared.tenant if declared is not None else "", [0, 0, 0, 0])
        for day, (requests, tokens) in days.items():
            if day == today:
                row[0] += requests
                row[1] += tokens
            if first <= day <= today:
                row[2] += requests
                row[3] += tokens
    return tuple(m.TenantUsage(tenant=t, requests_today=r[0], tokens_today=r[1], requests_7d=r[2], tokens_7d=r[3])
                 for t, r in sorted(sums.items(), key=lambda x: (-x[1][3], x[0])))


def key_usage(state: FleetState, now: datetime | None) -> list[tuple[str, str, int, int, int, int]]:
    """Every key the routers' maps named (the anonymous caller too), with its tenant: (key, tenant,
    requests today, tokens today, requests in seven days, tokens in seven days), the most tokens first."""
    today, first = _days(now)
    out = []
    for key, days in state.key_usage.items():
        declared = state.keys.get(key)
        week = [v for d, v in days.items() if first <= d <= today]
        now_ = days.get(today, [0, 0])
        out.append((key, declared.tenant if declared is not None else "", now_[0], now_[1],
                    sum(v[0] for v in week), sum(v[1] for v in week)))
    return sorted(out, key=lambda r: (-r[5], r[0]))


def keys_near_limits(state: FleetState, now: datetime | None) -> tuple[m.KeyNearLimit, ...]:
    today, _ = _days(now)
    out = []
    for name, key in sorted(state.keys.items()):
        if key.tokens_per_day is None:
            continue
        used = state.key_usage.get(name, {}).get(today, [0, 0])[1]
        if used >= NEAR_LIMIT * key.tokens_per_day:
            out.append(m.KeyNearLimit(name=name, tenant=key.tenant, tokens_today=used, tokens_per_day=key.tokens_per_day))
    return tuple(out)
