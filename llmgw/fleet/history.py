"""What the fold forgets about each model: its latest control events, and the GPU-time its stopped replicas held.

The fold keeps only what is true now (a stopped replica is gone), which is all
that status and placement need. ``ctl model show`` also lists a model's latest
events, and ``ctl model list`` the GPU-hours its replicas held today, stopped
ones included. ``ModelHistory`` keeps just that, noted from every decodable
control event (times clamped as the fold clamps them) in stream order, beside
the fold: it travels in the same checkpoint and fold snapshot, so a replay
from a snapshot reads only what came after it, and the projector's status
service and a replay here agree exactly. Its size follows the models and
their open replicas (and one figure per model per day), never the history.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta

from llmgw import messages as m
from llmgw.fleet.files import FETCHING_DETAIL
from llmgw.fleet.state import plane_gap

RECENT_EVENTS = 20  # per model: what ``ctl model show`` lists
COLD_STARTS_KEPT = 64  # per model: the ledger's latest wakes and scale-ups
ANSWERED_KEPT = 4096  # the routers' side of the ledger, by replica: a bound, not a window
WAITS_KEPT = 1024  # per cold start: held requests' waits


@dataclass
class _Held:
    model: str
    gpus: int
    nodes: tuple[str, ...]
    since: datetime


@dataclass
class _Start:
    """A wake or scale-up as the control stream tells it (the ledger's placed, started, healthy)."""

    replica_id: str
    cause: str
    placed_at: datetime
    started_at: datetime | None = None
    healthy_at: datetime | None = None
    fetching_at: datetime | None = None  # its agent fetched its files first (FETCHING_DETAIL)


@dataclass
class _Answered:
    """What the routers said of a woken replica (``WakeAnswered``), merged over routers."""

    held_since: datetime
    released_at: datetime
    first_byte_at: datetime
    requests: int
    waits_s: list[float]


def cause_of(event: m.ReplicaPlaced) -> str:
    """The ledger's code for a placement: wake, scale-up, or "" (not a cold start). Events older than
    ``ReplicaPlaced.cause`` say it only in their reason, which the scheduler has always begun so."""
    if event.cause:
        return event.cause
    if event.reason.startswith("woken by"):
        return "wake"
    return "scale-up" if event.reason.startswith("scaled up") else ""


@dataclass
class ModelHistory:
    """A model's latest control events and its stopped replicas' GPU-seconds per UTC day; ``note`` in stream order."""

    position: int = 0  # the last control-stream sequence noted
    recent: dict[str, list[m.ModelEvent]] = field(default_factory=dict)  # the latest RECENT_EVENTS, oldest first
    held_s: dict[tuple[str, date], float] = field(default_factory=dict)  # (model, day) → GPU-seconds, stopped replicas
    # The KV tokens its engines last said they reserved, since it was last declared (a new spec, a new plan),
    # and the node that said so: whether its card sized the cache is the fold's to say (``fleet.observed``).
    observed_kv: dict[str, int] = field(default_factory=dict)
    observed_on: dict[str, str] = field(default_factory=dict)
    placed: dict[str, _Held] = field(default_factory=dict)  # replicas placed and not yet stopped
    # The cold-start ledger: each model's latest wakes and scale-ups (placement order), how many in
    # all, and the routers' side by replica. The two sides are joined when asked (``cold_starts``),
    # so the answer does not depend on how the control and usage streams interleave.
    starts: dict[str, list[_Start]] = field(default_factory=dict)
    start_count: dict[str, int] = field(default_factory=dict)
    answered: dict[str, _Answered] = field(default_factory=dict)
    # A model whose engines keep failing to start: the last error line an agent reported, and when, until
    # one of its replicas is healthy or it is declared again (``model_state``'s "failing").
    failure: dict[str, str] = field(default_factory=dict)
    failure_at: dict[str, datetime] = field(default_factory=dict)
    # The control plane's recorded stop (None while it runs) and its last start: over a gap it was down,
    # the replicas it holds held nothing (``_gap``).
    down_since: datetime | None = None
    plane_started_at: datetime | None = None

    def note(self, seq: int, event: m.ControlEvent) -> None:
        """One control-stream event, at its sequence."""
        self.position = max(self.position, seq)
        if type(event) is m.ControlPlaneStopped:
            self.down_since = self.down_since or event.at
            return
        if type(event) is m.ControlPlaneStarted:
            self._gap(event)
            return
        model = about(event, self.placed)
        if model is None:
            return
        recent = self.recent.setdefault(model, [])
        recent.append(m.ModelEvent(seq=seq, event=event))
        if len(recent) > RECENT_EVENTS:
            del recent[0]
        match event:
            case m.ReplicaPlaced():
                self._close(event.replica_id, event.at)  # placed again under the same id: the first one ended
                self.placed[event.replica_id] = _Held(event.model, len(event.gpus), event.nodes, event.at)
                if cause := cause_of(event):
                    starts = self.starts.setdefault(model, [])
                    starts.append(_Start(event.replica_id, cause, event.at))
                    self.start_count[model] = self.start_count.get(model, 0) + 1
                    if len(starts) > COLD_STARTS_KEPT:
                        del starts[0]
            case m.ReplicaStateChanged():
                # One arm for both: a report that times a cold start may carry a reservation too.
                if event.observed_kv_tokens > 0:
                    self.observed_kv[model], self.observed_on[model] = event.observed_kv_tokens, event.node
                if event.state in ("starting", "healthy") and model in self.starts:
                    self._phase(model, event)
                if event.state == "healthy":
                    self.failure.pop(model, None)
                    self.failure_at.pop(model, None)
                elif failed(event.state, event.restarts):
                    self.failure[model], self.failure_at[model] = error_line(event.detail), event.at
            case m.ReplicaStopped():
                self._close(event.replica_id, event.at)
            case m.ModelDeclared():
                self.observed_kv.pop(model, None)
                self.observed_on.pop(model, None)
                self.failure.pop(model, None)  # a new declaration may be the fix: its replicas will say
                self.failure_at.pop(model, None)

    def _phase(self, model: str, event: m.ReplicaStateChanged) -> None:
        """A cold start's first start and first health, from its replica's reports."""
        for start in reversed(self.starts[model]):
            if start.replica_id == event.replica_id:
                if event.state == "starting" and event.detail.startswith(FETCHING_DETAIL):
                    start.fetching_at = start.fetching_at or event.at
                elif event.state == "starting" and start.started_at is None:
                    start.started_at = event.at
                elif event.state == "healthy" and start.healthy_at is None:
                    start.healthy_at = event.at
                break

    def note_answered(self, event: m.WakeAnswered) -> None:
        """A router's ``WakeAnswered`` (usage stream): merged with other routers' for the same replica."""
        known = self.answered.get(event.replica_id)
        if known is None:
            if len(self.answered) >= ANSWERED_KEPT:
                del self.answered[next(iter(self.answered))]
            self.answered[event.replica_id] = _Answered(event.held_since, event.released_at, event.at,
                                                        event.requests, sorted(event.waits_s)[:WAITS_KEPT])
            return
        known.held_since = min(known.held_since, event.held_since)
        known.released_at = min(known.released_at, event.released_at)
        known.first_byte_at = min(known.first_byte_at, event.at)
        known.requests += event.requests
        known.waits_s = sorted([*known.waits_s, *event.waits_s])[:WAITS_KEPT]

    def cold_starts(self, model: str) -> tuple[m.ColdStart, ...]:
        """The model's latest wakes and scale-ups, oldest first, each with every phase known."""
        out = []
        for s in self.starts.get(model, ()):
            a = self.answered.get(s.replica_id) if s.cause == "wake" else None
            out.append(m.ColdStart(
                replica_id=s.replica_id, model=model, cause=s.cause, placed_at=s.placed_at,
                wanted_at=a.held_since if a is not None else (s.placed_at if s.cause == "scale-up" else None),
                started_at=s.started_at, healthy_at=s.healthy_at, fetching_at=s.fetching_at,
                released_at=a.released_at if a is not None else None,
                first_byte_at=a.first_byte_at if a is not None else None,
                requests=a.requests if a is not None else 0, waits_s=tuple(a.waits_s) if a is not None else ()))
        return tuple(out)

    def events(self, model: str) -> tuple[m.ModelEvent, ...]:
        return tuple(self.recent.get(model, ()))

    def gpu_seconds_stopped(self, model: str, day: date) -> float:
        """GPU-seconds the model's replicas that stopped held on ``day`` (UTC)."""
        return self.held_s.get((model, day), 0.0)

    def _gap(self, event: m.ControlPlaneStarted) -> None:
        """A start after a gap: every replica held stops counting where the gap began and counts on from ``at``."""
        gap = plane_gap(self.down_since, self.plane_started_at, event)
        self.down_since, self.plane_started_at = None, event.at
        if gap is None:
            return
        begin, end = gap
        for held in self.placed.values():
            if held.since < begin:
                self._count(held, begin)
            held.since = max(held.since, end)

    def held_since(self, replica_id: str) -> datetime | None:
        """Since when a replica's GPU-time counts: its placement, or the end of the last gap after it."""
        held = self.placed.get(replica_id)
        return held.since if held is not None else None

    def _close(self, replica_id: str, at: datetime) -> None:
        held = self.placed.pop(replica_id, None)
        if held is None:
            return
        if self.down_since is not None:  # stopped while the control plane was down: it held nothing since
            at = min(at, self.down_since)
        self._count(held, at)

    def _count(self, held: _Held, at: datetime) -> None:
        for day, seconds in split_by_day(held.since, at):
            key = (held.model, day)
            self.held_s[key] = self.held_s.get(key, 0.0) + held.gpus * seconds


def about(event: m.Event, placed: dict[str, _Held] | None = None) -> str | None:
    """The model a control event is about, or None.

    A replica's state report counts only from a node the replica was placed on
    (the fold's rule), when ``placed`` says where replicas are.
    """
    match event:
        case m.ModelDeclared(spec=spec):
            return spec.name
        case m.ModelScaled() | m.ModelAutoscaled() | m.ModelRemoved() | m.ModelUnplaceable():
            return event.name
        case m.ReplicaPlaced() | m.ReplicaStopped():
            return event.model
        case m.ReplicaStateChanged():
            if placed is not None:
                held = placed.get(event.replica_id)
                if held is None or event.node not in held.nodes:
                    return None
                return held.model
            return event.model
    return None


def failed(state: str, restarts: int) -> bool:
    """Whether a replica's report says its engine failed: given up, or exited and is being restarted (a
    running engine's failed health check is unhealthy with no restart yet)."""
    return state == "failed" or (state in ("unhealthy", "starting") and restarts > 0)


# Where an agent's failure detail begins the engine's lines: after how it ended and what happens next.
_NODE = re.compile(r"^[\w.-]+: (?=engine (?:exited|failed)\b)")  # the fold's "node: " before a report
_EXITED = re.compile(r"^engine (?:exited|failed)\b.*?(?:; restart \d+ of \d+ in [\d.]+s| after \d+ restarts): ")
# A Python exception's last line (vLLM's traceback ends with what went wrong).
_EXCEPTION = re.compile(r"^\s*[\w.]*(?:Error|Exception)\b.*:")
_ERROR = re.compile(r"(?i)\b(?:error|failed|fatal|no such file|permission denied|out of memory|killed|"
                    r"segmentation fault|core dumped)\b|^\S+ E ")
_LOG_PREFIX = re.compile(r"^[\d.]+ [DIWE] (?:\w{3} +)?")  # llama.cpp's time and level
ERROR_LINE_MAX = 300


def error_line(detail: str) -> str:
    """The line of an engine failure's report that says what went wrong: a Python exception's last line,
    else the first error line (llama.cpp says the cause first and then what it stopped), else the first."""
    lines = [x.strip() for x in _EXITED.sub("", _NODE.sub("", detail, count=1), count=1).split(" | ") if x.strip()]
    if not lines:
        return detail[:ERROR_LINE_MAX]
    line = (next((x for x in reversed(lines) if _EXCEPTION.search(x) and "Traceback" not in x), None)
            or next((x for x in lines if _ERROR.search(x)), lines[0]))
    return _LOG_PREFIX.sub("", line)[:ERROR_LINE_MAX]


def split_by_day(start: datetime, end: datetime) -> list[tuple[date, float]]:
    """Seconds of [start, end) on each UTC day it touches."""
    start, end = start.astimezone(UTC), end.astimezone(UTC)
    out = []
    while start < end:
        midnight = datetime.combine(start.date() + timedelta(days=1), datetime.min.time(), UTC)
        stop = min(end, midnight)
        out.append((start.date(), (stop - start).total_seconds()))
        start = stop
    return out


def note_batch(history: ModelHistory, seqs: list[int], events: list[m.ControlEvent]) -> None:
    """Control events as a fold reads them (decoded, times clamped), in stream order."""
    note = history.note
    for seq, event in zip(seqs, events, strict=True):
        note(seq, event)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0–100) of ``values`` by the nearest rank; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil without floats going astray
    return ordered[min(int(rank), len(ordered)) - 1]
