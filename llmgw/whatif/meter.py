"""What a policy cost, measured alike for the recorded history and each policy (``llmgw.whatif.policies``), and the
engines' start-up times the policies' own engines take, from the cold-start ledger.

GPUs are shared by memory: a card counts as held while any replica books it, once however many do
(``gpu_hours``); what the replicas booked on it counts too (``booked_gib_hours``), which is the fairer
figure for packing. An idle replica idles its share of each card (what it booked ÷ the card).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

import msgspec

from llmgw import messages as m
from llmgw.fleet.files import FETCHING_DETAIL
from llmgw.fleet.history import cause_of, percentile
from llmgw.fleet.state import FleetState, plane_gap

IDLE_STRETCH_S = 60.0  # shorter gaps between requests are traffic, not idleness (a router tick is 10 s)
DEFAULT_START_S = 30.0  # an engine's start-up when the ledger knows none in the whole fleet


# --- what is measured --------------------------------------------------------------------------------------------


class Figures(msgspec.Struct, frozen=True, kw_only=True):
    """One policy's cost over the window (one model's, or all)."""

    gpu_hours: float  # cards held, each once while any replica books it
    booked_gib_hours: float  # GiB the replicas booked on them, × hours
    idle_gpu_hours: float
    cold_starts: int
    waited_requests: int
    added_wait_s_p50: float | None
    added_wait_s_p95: float | None
    unplaceable_minutes: float
    replicas_placed: int  # placements in the window (those running at its start not counted)


# One GPU a replica books: (node, index, MiB booked there, the card's MiB).
Hold = tuple[str, int, int, int]


def holds(state: FleetState | None, refs: Iterable[m.GpuRef]) -> tuple[Hold, ...]:
    """What a replica books on each of its GPUs: as placed, or (``mib`` 0, from before GPUs were
    shared) the whole card as the fold knows it; a card no inventory names counts what was booked."""
    out = []
    for g in refs:
        node = state.nodes.get(g.node) if state is not None else None
        gpu = node.gpus.get(g.index) if node is not None else None
        card = gpu.memory_mib if gpu is not None else g.mib
        out.append((g.node, g.index, g.mib or card, card))
    return tuple(out)


@dataclass
class _Open:
    model: str
    gpus: tuple[Hold, ...]
    since: datetime
    active: datetime | None = None  # healthy, then each request: where an idle stretch starts

    @property
    def share(self) -> float:
        """The cards' worth it books: 1 per whole card, less for a share of one."""
        return sum(min(mib / card, 1.0) if card > 0 else 1.0 for _, _, mib, card in self.gpus)


@dataclass
class _Acc:
    held: list[tuple[tuple[str, int], float, float]] = field(default_factory=list)  # (GPU, from, to): s from since
    mib_s: float = 0.0
    idle_s: float = 0.0
    cold: int = 0
    placed: int = 0
    waited: int = 0
    waits: list[float] = field(default_factory=list)
    unplaceable_s: float = 0.0


class Meter:
    """GPU-time held and idle, cold starts, waits and unplaceable time, per model, within [since, until]."""

    def __init__(self, since: datetime, wishes: bool = False, plane: FleetState | None = None) -> None:
        """``wishes``: holds come from routers' wishes, each saying how many wait in all (the recorded
        history's), which a router's ``WakeAnswered`` replaces with what it measured. ``plane``: the fold at
        ``since``, for whether the control plane is down then and when it last started."""
        self.since = since
        # The control plane's gaps in the window, and since when it is down now: no GPU is held, and no
        # replica idles, inside one (``_pieces``).
        self.gaps: list[tuple[datetime, datetime]] = []
        self.down_since = plane.plane_down_since if plane is not None else None
        self.plane_started = plane.plane_started_at if plane is not None else None
        self.wishes = wishes
        self.estimated: dict[str, list[float]] = {}  # per model, the waits a wake's wishes gave
        self.open: dict[str, _Open] = {}
        self.acc: dict[str, _Acc] = {}
        self.unplaceable: dict[str, datetime] = {}
        self.held: dict[str, list[tuple[datetime, int]]] = {}  # model → requests held (when, how many)

    def plane(self, event: m.ControlPlaneStopped | m.ControlPlaneStarted) -> None:
        """The control plane stopped, or started again: the gap it closes (``plane_gap``) counts for nothing."""
        if type(event) is m.ControlPlaneStopped:
            self.down_since = self.down_since or event.at
            return
        assert isinstance(event, m.ControlPlaneStarted)
        gap = plane_gap(self.down_since, self.plane_started, event)
        self.down_since, self.plane_started = None, event.at
        if gap is not None:
            self.gaps.append(gap)

    def gap_before(self, event: m.ControlPlaneStarted) -> datetime | None:
        """Where the gap this start closes began, or None: the policies decide nothing after it."""
        gap = plane_gap(self.down_since, self.plane_started, event)
        return gap[0] if gap is not None else None

    def _pieces(self, a: datetime, b: datetime) -> list[tuple[datetime, datetime]]:
        """[a, b] less the control plane's gaps (and the one it is in)."""
        if not self.gaps and self.down_since is None:
            return [(a, b)] if b > a else []
        gaps = self.gaps if self.down_since is None else [*self.gaps, (self.down_since, max(b, self.down_since))]
        out = [(a, b)] if b > a else []
        for g0, g1 in gaps:
            kept = []
            for x, y in out:
                if g1 <= x or g0 >= y:
                    kept.append((x, y))
                    continue
                if x < g0:
                    kept.append((x, g0))
                if g1 < y:
                    kept.append((g1, y))
            out = kept
        return out

    def _up_s(self, a: datetime, b: datetime) -> float:
        """Seconds of [a, b] the control plane was up."""
        return sum((y - x).total_seconds() for x, y in self._pieces(a, b))

    def _a(self, model: str) -> _Acc:
        a = self.acc.get(model)
        if a is None:
            a = self.acc[model] = _Acc()
        return a

    def placed(self, rid: str, model: str, gpus: tuple[Hold, ...], at: datetime, cause: str) -> None:
        self._stop(rid, at)
        self.open[rid] = _Open(model, gpus, max(at, self.since))
        a = self._a(model)
        if at >= self.since:
            a.placed += 1
            if cause:
                a.cold += 1
        self.placeable(model, at)

    def healthy(self, rid: str, at: datetime) -> None:
        o = self.open.get(rid)
        if o is not None and o.active is None:
            o.active = max(at, self.since)
        if o is not None:
            self.release(o.model, at)

    def request(self, rid: str, t: datetime) -> None:
        o = self.open.get(rid)
        if o is None or o.active is None or t <= o.active:
            return
        if (t - o.active).total_seconds() >= IDLE_STRETCH_S and (gap := self._up_s(o.active, t)) >= IDLE_STRETCH_S:
            self.acc[o.model].idle_s += gap * o.share
        o.active = t

    def _stop(self, rid: str, at: datetime) -> None:
        o = self.open.pop(rid, None)
        if o is None:
            return
        a = self.acc[o.model]
        end = max(at, o.since)
        mib = sum(mib for _, _, mib, _ in o.gpus)
        for x, y in self._pieces(o.since, end):
            start_s, end_s = (x - self.since).total_seconds(), (y - self.since).total_seconds()
            a.held.extend(((node, index), start_s, end_s) for node, index, _, _ in o.gpus)
            a.mib_s += (end_s - start_s) * mib
        if o.active is not None and (gap := self._up_s(o.active, end)) >= IDLE_STRETCH_S:
            a.idle_s += gap * o.share

    def stopped(self, rid: str, at: datetime) -> None:
        self._stop(rid, at)

    def hold(self, model: str, t: datetime, n: int) -> None:
        """``n`` requests for ``model`` held from ``t`` until a replica of it is healthy."""
        if t >= self.since:
            self.held.setdefault(model, []).append((t, n))

    def release(self, model: str, at: datetime) -> None:
        held = self.held.pop(model, None)
        if not held:
            return
        a = self._a(model)
        if self.wishes:  # each wish counts every request still waiting: the most of them waited, since the first
            n = max(x for _, x in held)
            waits = [max((at - held[0][0]).total_seconds(), 0.0)] * min(n, 1024)
            self.estimated[model] = waits
            a.waited += n
            a.waits.extend(waits)
            return
        for t, n in held:
            a.waited += n
            a.waits.extend([max((at - t).total_seconds(), 0.0)] * min(n, 1024))

    def release_one(self, model: str, held_at: datetime, at: datetime) -> None:
        """One request held since ``held_at`` went on at ``at`` (a wait known after the fact)."""
        held = self.held.get(model)
        if held and held[-1] == (held_at, 1):
            held.pop()
            a = self._a(model)
            a.waited += 1
            a.waits.append(max((at - held_at).total_seconds(), 0.0))

    def waits(self, model: str, waits: Iterable[float]) -> None:
        """Waits a router measured itself (``WakeAnswered``): they replace the held requests' estimate."""
        self.held.pop(model, None)
        a = self._a(model)
        for w in self.estimated.pop(model, ()):
            a.waited -= 1
            a.waits.remove(w)
        ws = list(waits)
        a.waited += len(ws)
        a.waits.extend(ws)

    def unplaceable_now(self, model: str, at: datetime) -> None:
        self.unplaceable.setdefault(model, max(at, self.since))

    def placeable(self, model: str, at: datetime) -> None:
        since = self.unplaceable.pop(model, None)
        if since is not None:
            self._a(model).unplaceable_s += self._up_s(since, at)

    def close(self, until: datetime) -> dict[str, Figures]:
        for rid in list(self.open):
            self._stop(rid, until)
        for model in list(self.unplaceable):
            self.placeable(model, until)
        for model, held in self.held.items():  # still waiting at the end: waited until then
            a = self._a(model)
            for t, n in held:
                a.waited += n
                a.waits.extend([max((until - t).total_seconds(), 0.0)] * min(n, 1024))
        self.held.clear()
        return {model: _figures([a]) for model, a in sorted(self.acc.items())}

    def total(self, models: tuple[str, ...] = ()) -> Figures:
        return _figures([a for k, a in self.acc.items() if not models or k in models])


def held_s(held: Iterable[tuple[tuple[str, int], float, float]]) -> float:
    """Seconds of GPU held: per GPU, the union of the stretches any replica booked it."""
    by: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for gpu, start, end in held:
        by.setdefault(gpu, []).append((start, end))
    total = 0.0
    for spans in by.values():
        spans.sort()
        start, end = spans[0]
        for s, e in spans[1:]:
            if s > end:
                total += end - start
                start, end = s, e
            elif e > end:
                end = e
        total += end - start
    return total


def _figures(accs: list[_Acc]) -> Figures:
    waits = [w for a in accs for w in a.waits]
    p50, p95 = percentile(waits, 50), percentile(waits, 95)
    return Figures(gpu_hours=round(held_s(x for a in accs for x in a.held) / 3600, 3),
                   booked_gib_hours=round(sum(a.mib_s for a in accs) / 1024 / 3600, 3),
                   idle_gpu_hours=round(sum(a.idle_s for a in accs) / 3600, 3),
                   cold_starts=sum(a.cold for a in accs), waited_requests=sum(a.waited for a in accs),
                   added_wait_s_p50=None if p50 is None else round(p50, 3),
                   added_wait_s_p95=None if p95 is None else round(p95, 3),
                   unplaceable_minutes=round(sum(a.unplaceable_s for a in accs) / 60, 2),
                   replicas_placed=sum(a.placed for a in accs))


def meter_event(meter: Meter, event: m.Event, state: FleetState | None = None) -> None:
    """The meter's part of a control event, recorded or decided; ``state``: the fold that knows the cards."""
    kind = type(event)
    if isinstance(event, m.ReplicaPlaced):
        meter.placed(event.replica_id, event.model, holds(state, event.gpus), event.at, cause_of(event))
    elif kind is m.ReplicaStopped:
        meter.stopped(event.replica_id, event.at)  # type: ignore[attr-defined]
    elif kind is m.ReplicaStateChanged and event.state == "healthy":  # type: ignore[attr-defined]
        meter.healthy(event.replica_id, event.at)  # type: ignore[attr-defined]
    elif kind is m.ModelUnplaceable:
        meter.unplaceable_now(event.name, event.at)  # type: ignore[attr-defined]
    elif kind is m.ModelScaled or kind is m.ModelAutoscaled or kind is m.ModelRemoved:
        meter.placeable(event.name, event.at)  # type: ignore[attr-defined]
    elif kind is m.ModelDeclared:
        meter.placeable(event.spec.name, event.at)  # type: ignore[attr-defined]
    elif kind is m.ControlPlaneStopped or kind is m.ControlPlaneStarted:
        meter.plane(event)  # type: ignore[arg-type]


# --- engines' start-up, from the ledger -----------------------------------------------------------------------------


@dataclass
class StartTimes:
    """Per model, placed → started and placed → healthy seconds the history shows; medians on asking."""

    samples: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    placed: dict[str, tuple[str, datetime]] = field(default_factory=dict)  # open: rid → (model, placed_at)
    started: dict[str, float] = field(default_factory=dict)
    fetching: dict[str, float] = field(default_factory=dict)  # open: when its agent began fetching its files

    def note(self, event: m.Event) -> None:
        kind = type(event)
        if kind is m.ReplicaPlaced:
            self.placed[event.replica_id] = (event.model, event.at)  # type: ignore[attr-defined]
        elif kind is m.ReplicaStateChanged:
            rid = event.replica_id  # type: ignore[attr-defined]
            opened = self.placed.get(rid)
            if opened is None:
                return
            s = (event.at - opened[1]).total_seconds()
            if event.state == "starting" and event.detail.startswith(FETCHING_DETAIL):  # type: ignore[attr-defined]
                self.fetching.setdefault(rid, s)
            elif event.state == "starting":  # type: ignore[attr-defined]
                self.started.setdefault(rid, s)
            elif event.state == "healthy":  # type: ignore[attr-defined]
                del self.placed[rid]
                started = self.started.pop(rid, s)
                # The engine's own start-up, without the download: a policy's placement pays that where
                # its node lacks the files (``fetch_s``), not everywhere.
                fetched = started - self.fetching.pop(rid) if rid in self.fetching else 0.0
                self.samples.setdefault(opened[0], []).append((min(started, s) - fetched, s - fetched))
            elif event.state == "failed":  # type: ignore[attr-defined]
                del self.placed[rid]
                self.started.pop(rid, None)
                self.fetching.pop(rid, None)
        elif kind is m.ReplicaStopped:
            self.placed.pop(event.replica_id, None)  # type: ignore[attr-defined]
            self.started.pop(event.replica_id, None)  # type: ignore[attr-defined]
            self.fetching.pop(event.replica_id, None)  # type: ignore[attr-defined]

    def seed(self, starts: Iterable[m.ColdStart]) -> None:
        for c in starts:
            if c.healthy_at is not None:
                h = (c.healthy_at - c.placed_at).total_seconds()
                s = (c.started_at - c.placed_at).total_seconds() if c.started_at else h
                fetched = c.download_s or 0.0
                self.samples.setdefault(c.model, []).append((min(s, h) - fetched, h - fetched))

    def of(self, model: str) -> tuple[float, float, str]:
        """(started, healthy) seconds after placement, and where they come from."""
        own = self.samples.get(model)
        pool = own or [x for xs in self.samples.values() for x in xs]
        if not pool:
            return 0.0, DEFAULT_START_S, f"none in the history: {DEFAULT_START_S:g}s assumed"
        s = percentile([a for a, _ in pool], 50) or 0.0
        h = percentile([b for _, b in pool], 50) or 0.0
        return s, h, (f"median of {len(own)}" if own else f"the fleet's median of {len(pool)}")
