"""The router's part of the cold-start ledger: when held requests came, went on, and were first answered.

A wake's phases on the control stream (placed, started, healthy) say nothing of the
requests that waited: only the router knows when it held the first one, when a
healthy replica let them go on and when the first answer came back. ``WakeLog``
notes that per model, under no lock and with no I/O, and hands each finished wake
on as a ``WakeAnswered`` for the router to publish with its next idle map.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from llmgw import messages as m
from llmgw.fleet.history import WAITS_KEPT


@dataclass
class _Wake:
    replica_id: str
    held_since: float
    released_at: float
    requests: int = 0
    waits_s: list[float] = field(default_factory=list)


def _t(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


class WakeLog:
    """Per model, the wake being answered; ``drain`` the finished ones as events."""

    def __init__(self) -> None:
        self.open: dict[str, _Wake] = {}
        self.done: list[tuple[str, _Wake, float]] = []

    def released(self, model: str, replica_id: str, held_since: float, now: float) -> None:
        """A request held since ``held_since`` (wall clock) goes on to ``replica_id`` now."""
        wake = self.open.get(model)
        if wake is None:
            wake = self.open[model] = _Wake(replica_id, held_since, now)
        wake.held_since = min(wake.held_since, held_since)
        wake.requests += 1
        if len(wake.waits_s) < WAITS_KEPT:
            wake.waits_s.append(max(now - held_since, 0.0))

    def answered(self, model: str, now: float) -> None:
        """The first byte of a released request's answer came back: the wake is done."""
        wake = self.open.pop(model, None)
        if wake is not None:
            self.done.append((model, wake, now))

    def drain(self, router: str, boot_id: str) -> list[m.WakeAnswered]:
        out = [m.WakeAnswered(at=_t(now), router=router, boot_id=boot_id, model=model, replica_id=w.replica_id,
                              held_since=_t(w.held_since), released_at=_t(w.released_at),
                              requests=w.requests, waits_s=tuple(round(x, 4) for x in w.waits_s))
               for model, w, now in self.done]
        self.done.clear()
        return out
