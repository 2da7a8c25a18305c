"""The EndpointSink: where each replica runs, learned from the control stream.

The control plane decides what should run; the router only follows replica
events and keeps, per model, the pool of replicas that may receive traffic
(``llmgw.fleet.pool``). It starts from the pool in the newest fold snapshot and
reads the control stream after it (with none, from sequence 1). The pool also
carries the outstanding-request counts that Acquire uses, so membership and load
live in one place and change without awaiting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus, RawMsg
from llmgw.fleet import snapshots
from llmgw.fleet.fold import Checkpoint, Memories, fold_batch
from llmgw.fleet.pool import Declared, Pool, Replica

__all__ = ["Declared", "EndpointSink", "Pool", "Replica"]

log = logging.getLogger(__name__)
_KEY_EVENTS = (m.KeyDeclared, m.KeyRevoked)

# A router folds the control stream and remembers only its pool.
ROUTER_KEEPS = Memories(history=False, demand=False, observed=False, pool=True, lost=False)


class EndpointSink:
    """Follows the control stream into a Pool, from the newest fold snapshot's pool (or sequence 1)."""

    def __init__(self, bus: Bus, pool: Pool | None = None,
                 on_change: Callable[[], None] | None = None, *, use_snapshots: bool = True) -> None:
        self.bus = bus
        self.pool = pool or Pool()
        # The fold of control this router keeps: the replicas (what refuses a stranger's report) and its pool.
        self.checkpoint = Checkpoint(pool=self.pool)
        self.refused = 0  # control events every fold refuses (fold.refusal)
        self.keys_by_id: dict[str, m.KeyDeclared] = {}  # the live API keys (ctl key), by key id
        self.on_change = on_change
        self.use_snapshots = use_snapshots
        self.started_from = ""  # the fold snapshot the pool started from, or "" (sequence 1)
        self.applied_seq = 0
        self.skipped = 0
        self.caught_up = asyncio.Event()
        self._changed = asyncio.Condition()

    @property
    def bad_events(self) -> int:
        """Control events skipped: undecodable, a subject its payload disagrees with, or state from a stranger."""
        return self.skipped + self.refused

    def _skipped(self, raw: RawMsg, error: Exception) -> None:
        self.skipped += 1  # recorded and skipped: one bad event must not stop routing

    def _index_keys(self) -> None:
        """The live keys by id, for the router's lookup: rebuilt when a key event is folded, never per request."""
        self.keys_by_id = {k.lookup_id: k for k in self.checkpoint.state.keys.values()}

    async def start_from_snapshot(self) -> None:
        """Take the pool of the newest fold snapshot as the pool so far (none: sequence 1)."""
        found = await snapshots.newest(self.bus, "router", (subjects.STREAM_CONTROL,))
        if found is None:
            return
        c, self.started_from = found
        now, seeded = time.time(), c.pool
        for rep in seeded.replicas.values():
            if rep.in_pool:
                rep.pooled_at = now  # as a fold from sequence 1 at start-up: pooled by this router now
        for f in dataclasses.fields(Pool):  # the router holds self.pool: filled in place, every field
            setattr(self.pool, f.name, getattr(seeded, f.name))
        self.checkpoint = Checkpoint(state=c.state, cursor=c.cursor, pool=self.pool)
        self._index_keys()
        self.applied_seq = c.cursor.positions.get(subjects.STREAM_CONTROL, 0)
        if self.on_change is not None:
            self.on_change()

    async def run(self) -> None:
        """Follow forever; cancel to stop. ``caught_up`` is set once history is in.

        After an error, calling it again resumes after the last event applied.
        """
        if self.use_snapshots and self.applied_seq == 0:
            await self.start_from_snapshot()
        target = await self.bus.stream_last_seq(subjects.STREAM_CONTROL)
        if target <= self.applied_seq:
            self.caught_up.set()
        follower = self.bus.follow(subjects.STREAM_CONTROL, m.CONTROL_DECODER, self.applied_seq + 1, who="router",
                                   on_skip=self._skipped)
        async for batch in follower.batches():
            why = fold_batch(self.checkpoint, subjects.STREAM_CONTROL, [d.raw for d in batch],
                             [d.event for d in batch], keep=ROUTER_KEEPS, now=time.time(), subjects_checked=True)
            refused = sum(w is not None for w in why)
            self.refused += refused
            if any(type(d.event) in _KEY_EVENTS for d in batch):
                self._index_keys()
            changed = refused < len(batch)
            self.applied_seq = follower.last_seq
            if self.applied_seq >= target:
                self.caught_up.set()
            if changed and self.on_change is not None:
                self.on_change()
            async with self._changed:
                self._changed.notify_all()

    async def wait_for(self, predicate: Callable[[Pool], bool], within: float = 10.0) -> None:
        """Wait until the pool satisfies ``predicate``; TimeoutError after ``within`` seconds."""
        async def waiter() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: predicate(self.pool))

        async with asyncio.timeout(within):
            await waiter()
