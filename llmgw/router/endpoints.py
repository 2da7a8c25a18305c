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

__all__ = ["Declared", "EndpointSink", "EngineKeys", "Pool", "Replica"]

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


class EngineKeys:
    """The engines' API keys (``EngineKeyIssued``), followed from their stream, by endpoint: what
    ``Upstream`` sends each engine as ``Authorization``. Only routers may read that stream.

    A key is taken only from the agent of the node that serves the replica (its head, once the pool knows
    it): another node's agent cannot make this router send a replica's engine a key of its choosing.
    """

    MAX_ENDPOINTS = 100_000  # endpoints come and go; the oldest are forgotten past this

    def __init__(self, bus: Bus, pool: Pool) -> None:
        self.bus, self.pool = bus, pool
        self._by_endpoint: dict[str, dict[str, m.EngineKeyIssued]] = {}  # endpoint -> node -> its latest
        self._endpoint_of: dict[tuple[str, str], str] = {}  # (replica, node) -> the endpoint of its latest key
        self.applied_seq = 0
        self.skipped = 0
        self.caught_up = asyncio.Event()

    def key_for(self, endpoint: str) -> str | None:
        """The key the engine at ``endpoint`` takes; None when this router knows none."""
        found = self._by_endpoint.get(endpoint)
        if not found:
            return None
        for node, issued in found.items():
            rep = self.pool.replicas.get(issued.replica_id)
            if rep is None or not rep.nodes or rep.nodes[0] == node:
                return issued.key
        return None

    def _skipped(self, raw: RawMsg, error: Exception) -> None:
        self.skipped += 1

    def apply(self, subject: str, issued: m.EngineKeyIssued) -> bool:
        """Keep a key reported on its own subject (the node's agent), in place of that engine's last one."""
        if subject != subjects.engine_key(issued.replica_id, issued.node):
            self.skipped += 1
            return False
        old = self._endpoint_of.pop((issued.replica_id, issued.node), None)
        if old is not None and (held := self._by_endpoint.get(old)) is not None:
            held.pop(issued.node, None)
            if not held:
                del self._by_endpoint[old]
        while len(self._endpoint_of) >= self.MAX_ENDPOINTS:
            (rid, node), ep = next(iter(self._endpoint_of.items()))
            del self._endpoint_of[(rid, node)]
            if (held := self._by_endpoint.get(ep)) is not None and held.pop(node, None) is not None and not held:
                del self._by_endpoint[ep]
        self._by_endpoint.setdefault(issued.endpoint, {})[issued.node] = issued
        self._endpoint_of[(issued.replica_id, issued.node)] = issued.endpoint
        return True

    async def run(self) -> None:
        """Follow forever from the stream's start (it keeps only each engine's latest); cancel to stop."""
        target = await self.bus.stream_last_seq(subjects.STREAM_ENGINE_KEYS)
        if target <= self.applied_seq:
            self.caught_up.set()
        follower = self.bus.follow(subjects.STREAM_ENGINE_KEYS, m.ENGINE_KEY_DECODER, self.applied_seq + 1,
                                   who="router", on_skip=self._skipped)
        async for batch in follower.batches():
            for d in batch:
                self.apply(d.raw.subject, d.event)
            self.applied_seq = follower.last_seq
            if self.applied_seq >= target:
                self.caught_up.set()
