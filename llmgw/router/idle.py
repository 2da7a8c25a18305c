"""What the router knows about use: the last request per replica, and the idle map it publishes once a tick.

A replica with no request since this router started is absent from ``last_request``:
unknown is not idle.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import NamedTuple

from llmgw import messages as m
from llmgw.router.endpoints import Pool


class IdleFor(NamedTuple):
    """How long nobody asked for a replica; ``seconds`` means something only when ``known``."""

    seconds: float
    known: bool


class IdleTracker:
    """Last request time per replica, written by acquire, read once a tick."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.tick = 0

    def idle_for(self, replica_id: str, now: float) -> IdleFor:
        """A value and a flag: a replica this router has not served is unknown, not idle."""
        t = self.last.get(replica_id)
        if t is None:
            return IdleFor(-1.0, False)
        return IdleFor(max(0.0, now - t), True)

    def idle_map(self, router: str, boot_id: str, pool: Pool, at: datetime,
                 queued: dict[str, int] | None = None, tick_s: float = 0.0, control_seq: int = 0) -> m.IdleMapPublished:
        """The next tick's map: requests seen, pooled replicas with none since they joined, and demand."""
        self.tick += 1
        # Stopped replicas leave the map: its size follows the fleet, not its history.
        for rid in [rid for rid in self.last if rid not in pool.replicas]:
            del self.last[rid]
        last = {rid: datetime.fromtimestamp(t, UTC) for rid, t in self.last.items()}
        since = {
            r.replica_id: datetime.fromtimestamp(r.pooled_at, UTC)
            for reps in pool.healthy.values()
            for r in reps
            if r.replica_id not in self.last
        }
        queued = queued or {}
        in_flight: dict[str, int] = {}
        busy: dict[str, int] = {}
        for r in pool.replicas.values():
            if r.outstanding > 0:
                busy[r.replica_id] = r.outstanding
                in_flight[r.model] = in_flight.get(r.model, 0) + r.outstanding
        # Every declared model, zeros included: a quiet model is what lets the autoscaler scale down.
        names = set(pool.declared) | set(in_flight) | {n for n, q in queued.items() if q}
        load = {n: m.ModelLoad(in_flight=in_flight.get(n, 0), queued=queued.get(n, 0),
                               replicas=len(pool.healthy.get(n, ()))) for n in sorted(names)}
        return m.IdleMapPublished(at=at, router=router, boot_id=boot_id, tick=self.tick,
                                  last_request=last, serving_since=since, load=load, busy=busy, tick_s=tick_s,
                                  control_seq=control_seq)
