"""The scheduler process: fold fleet, control and usage live, hold the lease, publish decisions.

Exactly one scheduler decides at a time. A NATS KV key holds the lease: it is
created by the one that gets it, renewed by revision (an update that names a
stale revision fails, so a scheduler that slept through its TTL learns it lost
the lease before it publishes), and expires by the bucket's TTL when its
holder dies. A leader also decides only once its fold has caught up to every
stream's last sequence, and after publishing waits until its own decisions
come back through the fold, so it never decides twice on a stale view.

At start-up it folds the streams from sequence 1: its decisions hold GPUs and start
engines, and a fold snapshot is checked against the streams only for placements and
endpoints, not for the models, nodes and demand it decides from (whoever can write
snapshots could otherwise declare a model with engine arguments of its choosing). With
``use_snapshots=True`` (``llmgw scheduler --from-snapshot``: when the snapshot writer is
trusted as much as the scheduler) it starts from the newest snapshot and reads only
what came after.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus, RawMsg
from llmgw.bus.keyvalue import KeyValueBucket
from llmgw.errors import BusError
from llmgw.fleet import snapshots
from llmgw.fleet.demand import SchedulerMemory
from llmgw.fleet.fold import Checkpoint, fold_batch
from llmgw.fleet.state import FleetState
from llmgw.scheduler import placement as scheduler
from llmgw.scheduler.maintenance import QUARANTINE, Quarantine

log = logging.getLogger(__name__)

LEASE_KEY = "leader"
FOLLOWED = (subjects.STREAM_FLEET, subjects.STREAM_CONTROL, subjects.STREAM_USAGE)

Service = Callable[[Bus], Awaitable[None]]


class Lease:
    """A KV lease: ``acquire`` creates the key, ``renew`` updates it by revision."""

    def __init__(self, bus: Bus, holder: str, ttl_s: float) -> None:
        self.bus = bus
        self.holder = holder
        self.ttl_s = ttl_s
        self.revision: int | None = None
        self._kv: KeyValueBucket | None = None

    async def _bucket(self) -> KeyValueBucket:
        if self._kv is None:
            kv = await self.bus.key_value(subjects.SCHEDULER_LEASE_BUCKET, self.ttl_s)
            # The bucket's TTL is what expires a lease, and admin declared it: say when it is not ours.
            declared = await kv.ttl_s()
            if declared and abs(declared - self.ttl_s) > 1e-3:
                log.warning("scheduler %s: the lease bucket %s expires a lease after %gs, as declared "
                            "(`llmgw declare-streams --lease-ttl`); --lease-ttl %gs does not change that",
                            self.holder, subjects.SCHEDULER_LEASE_BUCKET, declared, self.ttl_s)
                self.ttl_s = declared
            self._kv = kv
        return self._kv

    @property
    def held(self) -> bool:
        return self.revision is not None

    async def acquire(self) -> bool:
        """Take the lease if nobody holds it; any refusal or error means "not now"."""
        try:
            kv = await self._bucket()
            self.revision = await kv.create(LEASE_KEY, self.holder.encode())
        except BusError as e:  # the key exists, or the bus is away: either way, not leader
            log.debug("lease not acquired: %s", e)
            self.revision = None
        return self.held

    async def renew(self) -> bool:
        """Extend the lease; fails when someone else took it since our revision."""
        if self.revision is None:
            return False
        try:
            kv = await self._bucket()
            self.revision = await kv.update(LEASE_KEY, self.holder.encode(), last=self.revision)
        except BusError as e:  # wrong revision or no answer: stop deciding
            log.warning("scheduler %s lost the lease: %s", self.holder, e)
            self.revision = None
        return self.held

    async def release(self) -> None:
        """Give the lease up at once so another scheduler need not wait for the TTL."""
        if self.revision is None:
            return
        with contextlib.suppress(BusError):
            kv = await self._bucket()
            await kv.delete(LEASE_KEY, last=self.revision)
        self.revision = None


@dataclass
class SchedulerStats:
    decisions: int = 0
    duplicates: int = 0
    malformed: int = 0
    clamped: int = 0
    refused: int = 0  # as every fold refuses them (fold.refusal): folded past, not applied
    passes: int = 0
    applied: dict[str, int] = field(default_factory=dict)
    started_from: str = ""  # the fold snapshot the fold started from, or "" (sequence 1)


class SchedulerService:
    """One scheduler: folds live, decides while it holds the lease."""

    def __init__(
        self,
        bus: Bus,
        *,
        name: str = "",
        lease_ttl_s: float = 10.0,
        tick_s: float = 1.0,
        clock: Callable[[], datetime] = m.utcnow,
        services: tuple[Service, ...] = (),
        use_snapshots: bool = False,
        quarantine: Quarantine = QUARANTINE,
    ) -> None:
        self.bus = bus
        self.name = name or f"scheduler-{uuid.uuid4().hex[:8]}"
        self.lease = Lease(bus, self.name, lease_ttl_s)
        self.tick_s = tick_s
        self.clock = clock
        self.services = services
        self.use_snapshots = use_snapshots
        self.quarantine = quarantine
        self.checkpoint = Checkpoint()
        self.stats = SchedulerStats(applied={s: 0 for s in FOLLOWED})
        self.published: list[m.Event] = []
        self._changed = asyncio.Event()

    @property
    def state(self) -> FleetState:
        return self.checkpoint.state

    @property
    def memory(self) -> SchedulerMemory:
        return self.checkpoint.demand

    def _skipped(self, raw: RawMsg, error: Exception) -> None:
        self.stats.malformed += 1  # recorded and skipped: a malformed event must not stop placement

    async def start_from_snapshot(self) -> None:
        """Take the newest fold snapshot of every followed stream as the fold so far (none: sequence 1)."""
        found = await snapshots.newest(self.bus, f"scheduler {self.name}", FOLLOWED)
        if found is None:
            return
        self.checkpoint, self.stats.started_from = found
        for s in FOLLOWED:
            self.stats.applied[s] = self.checkpoint.cursor.positions.get(s, 0)

    async def _follow(self, stream: str) -> None:
        follower = self.bus.follow(stream, m.ANY_DECODER, self.stats.applied[stream] + 1, who="scheduler",
                                   on_skip=self._skipped)
        async for batch in follower.batches():
            c = self.checkpoint
            clamped = c.cursor.clamped
            why = fold_batch(c, stream, [d.raw for d in batch], [d.event for d in batch], subjects_checked=True)
            self.stats.clamped += c.cursor.clamped - clamped
            self.stats.refused += sum(w is not None for w in why)
            self.stats.applied[stream] = follower.last_seq
            self._changed.set()

    async def _caught_up(self) -> bool:
        for stream in FOLLOWED:
            if self.stats.applied[stream] < await self.bus.stream_last_seq(stream):
                return False
        return True

    async def _wait_applied(self, stream: str, seq: int, within_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while self.stats.applied[stream] < seq and loop.time() < deadline:
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(max(deadline - loop.time(), 0.01)):
                    await self._changed.wait()

    async def step(self) -> list[m.Event]:
        """One pass: decide and publish if leader and caught up; what was published."""
        self.stats.passes += 1
        if not self.lease.held and not await self.lease.acquire():
            return []
        if not await self._caught_up():
            return []
        # Renewing by revision right before publishing is the fence: a scheduler
        # whose lease expired while it was stalled finds out here, not after.
        if not await self.lease.renew():
            return []
        decisions = scheduler.decide(self.state, self.memory, self.clock(), self.quarantine)
        if not decisions:
            return []
        last_seq = 0
        out: list[m.Event] = []
        for d in decisions:
            ack = await self.bus.publish(d.event, msg_id=d.msg_id)
            last_seq = max(last_seq, ack.seq)
            self.stats.decisions += 1
            self.stats.duplicates += ack.duplicate
            out.append(d.event)
            log.info("scheduler %s: %s", self.name, m.describe(d.event))
        self.published.extend(out)
        await self._wait_applied(subjects.STREAM_CONTROL, last_seq, within_s=max(self.tick_s * 5, 5.0))
        return out

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Fold and decide until ``stop`` is set (or forever); releases the lease on the way out."""
        stop = stop or asyncio.Event()
        if self.use_snapshots and not any(self.stats.applied.values()):
            await self.start_from_snapshot()
        tasks = [asyncio.create_task(self._follow(s), name=f"follow-{s}") for s in FOLLOWED]
        tasks += [asyncio.create_task(_as_coro(svc(self.bus)), name="service") for svc in self.services]
        try:
            while not stop.is_set():
                for t in tasks:
                    if t.done() and not t.cancelled() and t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
                try:
                    await self.step()
                except Exception as e:  # noqa: BLE001 - an outage must not kill the scheduler
                    log.warning("scheduler %s: pass failed: %s", self.name, e)
                self._changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    async with asyncio.timeout(self.tick_s):
                        await _first(stop, self._changed)
                # Let a burst of events land before deciding on it.
                await asyncio.sleep(min(0.05, self.tick_s))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.lease.release()


async def _as_coro(aw: Awaitable[None]) -> None:
    await aw


async def _first(*events: asyncio.Event) -> None:
    waits = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
