"""The planner service: plan requests in over NATS, candidates out, against its own fold of the fleet.

It folds the fleet stream (which GPUs exist, their health, lost nodes) and the
control stream (which GPUs replicas hold) with the one fold the projector uses,
following both live. It answers on ``subjects.PLAN`` in the queue group
``subjects.PLANNER_QUEUE``, so that several planners share the load. A request
that cannot be decoded or makes no sense gets an error reply (Bus.serve); an
event that cannot be decoded is logged with its sequence, counted and skipped.
At start-up its fold and the observed KV reservations come from the newest fold
snapshot (``llmgw/fleet/snapshots.py``), so a restart reads only what came after.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus, RawMsg
from llmgw.errors import PlanError, ServiceError
from llmgw.fleet import snapshots
from llmgw.fleet.fold import Checkpoint, Memories, fold_batch
from llmgw.fleet.state import FleetState
from llmgw.planner import candidates as planner
from llmgw.planner import modelinfo

log = logging.getLogger(__name__)

# The planner folds the fleet and control streams and remembers only what engines reserved.
PLANNER_KEEPS = Memories(history=False, demand=False, observed=True, pool=False, lost=False)
_FOLLOWED = ((subjects.STREAM_FLEET, m.FLEET_DECODER), (subjects.STREAM_CONTROL, m.CONTROL_DECODER))


class PlannerService:
    """One planner: an in-memory fold of the fleet and control streams, and the plan handler."""

    def __init__(self, bus: Bus, *, models_dir: str | Path | None = None, cache_size: int = 256,
                 use_snapshots: bool = True) -> None:
        self.bus = bus
        self.models_dir = models_dir
        # The fleet fold and the one memory the planner keeps: what engines of a spec reserved.
        self.checkpoint = Checkpoint()
        self.positions: dict[str, int] = {}
        self.skipped = 0
        self.clamped = 0  # events folded at their store time (see fold.clamp_times)
        self.answered = 0
        self.ready = asyncio.Event()
        self._models: dict[tuple[str, int | None], m.ModelInfo] = {}
        self._cache_size = cache_size
        self._progress = asyncio.Event()
        self._pools: dict[str, planner.ClassPool] | None = None  # pools of the fold, until it changes
        self.refused = 0  # events every fold refuses (fold.refusal)
        self.use_snapshots = use_snapshots
        self.started_from = ""  # the fold snapshot the fold started from, or "" (sequence 1)

    @property
    def state(self) -> FleetState:
        return self.checkpoint.state

    @property
    def observed(self) -> dict[str, int]:
        """What healthy engines reserved, per spec: KV tokens by fleet.observed.observation_key."""
        return self.checkpoint.observed

    @property
    def refused_observations(self) -> int:
        """Reservations refused as implausible or not from the replica's own node."""
        return self.checkpoint.refused_observations

    # --- requests ---------------------------------------------------------------------

    async def model(self, name: str, params: int | None) -> m.ModelInfo:
        """A model's facts, read once and kept (config files do not change under a repo revision)."""
        key = (name, params)
        info = self._models.get(key)
        if info is None:
            info = await asyncio.to_thread(modelinfo.load, name, models_dir_=self.models_dir, params=params)
            if len(self._models) >= self._cache_size:
                self._models.pop(next(iter(self._models)))
            self._models[key] = info
        return info

    async def handle(self, data: bytes) -> bytes:
        """Answer one plan request; anything raised becomes an error reply."""
        try:
            request = m.PLAN_REQUEST_DECODER.decode(data)
        except m.DECODE_ERRORS as e:
            raise PlanError(f"malformed plan request ({e}); send a PlanRequest as JSON, e.g. {{\"model\": \"Org/Name\"}}") from e
        info = request.info or await self.model(request.model, request.params)
        if self._pools is None:
            self._pools = planner.pools(self.state)
        # The fold keeps each node's reported engine versions: plans are made for what the fleet runs.
        reply = planner.plan(info, self.state, request, fleet_pools=self._pools, observed=self.observed)
        self.answered += 1
        return m.encode(reply)

    # --- the fold ---------------------------------------------------------------------

    async def start_from_snapshot(self) -> None:
        """Take the newest fold snapshot as the fold so far (none: sequence 1)."""
        found = await snapshots.newest(self.bus, "planner", tuple(s for s, _ in _FOLLOWED))
        if found is not None:
            c, self.started_from = found
            self.checkpoint = Checkpoint(state=c.state, cursor=c.cursor, observed=c.observed)
            self.positions = {s: c.cursor.positions.get(s, 0) for s, _ in _FOLLOWED}

    async def _follow(self, stream: str, decoder: msgspec.json.Decoder[Any]) -> None:
        follower = self.bus.follow(stream, decoder, self.positions.get(stream, 0) + 1, idle_expires_s=2.0,
                                   who="planner", on_skip=self._skipped)
        async for batch in follower.batches():
            c = self.checkpoint
            clamped = c.cursor.clamped
            why = fold_batch(c, stream, [d.raw for d in batch], [d.event for d in batch], keep=PLANNER_KEEPS,
                             subjects_checked=True)
            self.clamped += c.cursor.clamped - clamped
            self.refused += sum(w is not None for w in why)
            self._pools = None
            self.positions[stream] = follower.last_seq
            self._progress.set()

    def _skipped(self, raw: RawMsg, error: Exception) -> None:
        self.skipped += 1

    async def wait_for(self, positions: dict[str, int], timeout: float = 10.0) -> None:  # noqa: ASYNC109 - bounded wait is the point
        """Return once the fold has reached these stream sequences."""
        await self.wait_until(lambda _: all(self.positions.get(s, 0) >= seq for s, seq in positions.items()), timeout)

    async def wait_until(self, predicate: Callable[[FleetState], bool], timeout: float = 10.0) -> None:  # noqa: ASYNC109
        """Return once the folded state satisfies ``predicate``; TimeoutError after ``timeout``."""

        async def reached() -> None:
            while not predicate(self.state):
                self._progress.clear()
                await self._progress.wait()

        async with asyncio.timeout(timeout):
            await reached()

    async def run(self, *, catch_up_timeout: float = 30.0) -> None:
        """Catch up with both streams, then answer requests and follow live until cancelled."""
        targets = {stream: await self.bus.stream_last_seq(stream) for stream, _ in _FOLLOWED}
        if self.use_snapshots and not self.positions:
            await self.start_from_snapshot()
        tasks = [asyncio.create_task(self._follow(s, d), name=f"planner-follow-{s}") for s, d in _FOLLOWED]
        sub = None
        try:
            try:
                await self.wait_for(targets, catch_up_timeout)
            except TimeoutError:
                log.warning("planner: not caught up with %s after %.0fs; answering from what is folded", targets, catch_up_timeout)
            sub = await self.bus.serve(subjects.PLAN, self.handle, queue=subjects.PLANNER_QUEUE)
            self.ready.set()
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                t.result()  # a follower that died takes the service down loudly
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()


async def ask(bus: Bus, request: m.PlanRequest, *, timeout: float | None = None) -> m.PlanReply:  # noqa: ASYNC109
    """Ask a running planner over NATS."""
    data = await bus.request(subjects.PLAN, m.encode(request), timeout=timeout, service="planner")
    try:
        return m.PLAN_REPLY_DECODER.decode(data)
    except m.DECODE_ERRORS as e:
        raise ServiceError(f"the planner answered something that is not a plan ({e}); is it the same llmgw version?") from e
