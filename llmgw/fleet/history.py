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

from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta

from llmgw import messages as m

RECENT_EVENTS = 20  # per model: what ``ctl model show`` lists


@dataclass
class _Held:
    model: str
    gpus: int
    nodes: tuple[str, ...]
    since: datetime


@dataclass
class ModelHistory:
    """A model's latest control events and its stopped replicas' GPU-seconds per UTC day; ``note`` in stream order."""

    position: int = 0  # the last control-stream sequence noted
    recent: dict[str, list[m.ModelEvent]] = field(default_factory=dict)  # the latest RECENT_EVENTS, oldest first
    held_s: dict[tuple[str, date], float] = field(default_factory=dict)  # (model, day) → GPU-seconds, stopped replicas
    # The KV tokens its engines last said they reserved, since it was last declared (a new spec, a new plan).
    observed_kv: dict[str, int] = field(default_factory=dict)
    placed: dict[str, _Held] = field(default_factory=dict)  # replicas placed and not yet stopped

    def note(self, seq: int, event: m.ControlEvent) -> None:
        """One control-stream event, at its sequence."""
        self.position = max(self.position, seq)
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
            case m.ReplicaStopped():
                self._close(event.replica_id, event.at)
            case m.ReplicaStateChanged() if event.observed_kv_tokens > 0:
                self.observed_kv[model] = event.observed_kv_tokens
            case m.ModelDeclared():
                self.observed_kv.pop(model, None)

    def events(self, model: str) -> tuple[m.ModelEvent, ...]:
        return tuple(self.recent.get(model, ()))

    def gpu_seconds_stopped(self, model: str, day: date) -> float:
        """GPU-seconds the model's replicas that stopped held on ``day`` (UTC)."""
        return self.held_s.get((model, day), 0.0)

    def _close(self, replica_id: str, at: datetime) -> None:
        held = self.placed.pop(replica_id, None)
        if held is None:
            return
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
