"""Turning silence into facts: ``NodeLost`` after missed heartbeats, ``NodeReturned`` after.

Heartbeats are not history; the monitor follows their stream and publishes
the facts to the fleet stream with deterministic msg ids, so that two
monitors watching the same silence store one ``NodeLost``, not two.

Silence counts only while the monitor could hear: with the bus down it judges
nobody, and once the bus is back it reads the heartbeats afresh and measures
silence from the first one it hears again (or from the return, if none comes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus, RawMsg
from llmgw.errors import BusError
from llmgw.fleet import snapshots
from llmgw.fleet.fold import Checkpoint, Memories, fold_batch

log = logging.getLogger(__name__)

# The monitor folds the fleet stream's lost, returned and retired events and remembers who is lost.
LIVENESS_KEEPS = Memories(history=False, demand=False, observed=False, pool=False, lost=True)


@dataclass
class _Heard:
    boot_id: str
    seq: int
    at: datetime  # the agent's clock, for NodeLost.last_heartbeat_at
    received: datetime  # the server's clock, for measuring silence


@dataclass
class _Lost:
    key: str  # "<boot>:<seq>" of the last heartbeat before the silence
    stream_seq: int  # where NodeLost was stored: NodeReturned's id answers it


class HeartbeatMonitor:
    """Follow ``LLMGW_HEARTBEAT``; publish ``NodeLost``/``NodeReturned`` to the fleet stream."""

    def __init__(
        self,
        bus: Bus,
        *,
        timeout_s: float = 60.0,
        check_every_s: float | None = None,
        now: Callable[[], datetime] = m.utcnow,
        use_snapshots: bool = True,
    ) -> None:
        self.bus = bus
        self.use_snapshots = use_snapshots
        self.started_from = ""  # the fold snapshot the lost nodes came from, or "" (the fleet stream from 1)
        self.timeout_s = timeout_s
        self.check_every_s = check_every_s or min(max(timeout_s / 10, 0.1), 5.0)
        self._now = now
        self.heard: dict[str, _Heard] = {}
        self.lost: dict[str, _Lost] = {}
        self.published: list[m.NodeLost | m.NodeReturned] = []
        self.malformed = 0
        self.ready = asyncio.Event()
        # Silence is only what this monitor watched: heartbeats stored before it
        # started (a control plane that was down for an hour) prove nothing, and
        # neither does an outage of the bus; ``started`` moves to its end.
        self.started: datetime | None = None
        self.outages = 0
        self._next_seq = 1  # of the heartbeat stream: where a fresh reader starts
        self._reconnects = 0
        self._down = False
        self._deaf = False  # the bus went away; until the first heartbeat after it, silence proves little

    # --- what the fleet stream already says -------------------------------------------

    async def _load_lost(self) -> None:
        """Which nodes are lost now, per the NodeLost/NodeReturned already stored (from the newest
        fold snapshot's, then the fleet stream after it)."""
        last = await self.bus.stream_last_seq(subjects.STREAM_FLEET)
        if last == 0:
            return
        c = Checkpoint()
        found = await snapshots.newest(self.bus, "liveness", (subjects.STREAM_FLEET,)) if self.use_snapshots else None
        if found is not None:
            c, self.started_from = found
        start = c.cursor.positions.get(subjects.STREAM_FLEET, 0) + 1
        if start <= last:
            # Unfiltered: a filtered reader never reaches stop_at when the last event is not one of ours.
            follower = self.bus.follow(subjects.STREAM_FLEET, m.FLEET_DECODER, start, stop_at=last,
                                       idle_expires_s=2.0, who="liveness",
                                       keep=lambda raw: raw.subject.rsplit(".", 1)[-1] in ("lost", "returned", "retired"),
                                       on_skip=self._skipped)
            async for batch in follower.batches():
                fold_batch(c, subjects.STREAM_FLEET, [d.raw for d in batch], [d.event for d in batch],
                           keep=LIVENESS_KEEPS, subjects_checked=True)
        self.lost = {node: _Lost(key="", stream_seq=seq) for node, seq in c.lost_at_seq.items()}

    # --- following heartbeats -------------------------------------------------------------

    def _skipped(self, raw: RawMsg, error: Exception) -> None:
        self.malformed += 1

    def _on_heartbeat(self, raw: RawMsg, hb: m.HeartbeatSent) -> None:
        received = datetime.fromtimestamp(raw.ts_ns / 1e9, UTC)
        if self._deaf:
            # The first heartbeat after an outage: from here on the monitor hears again.
            self._deaf = False
            self.started = max(self.started or received, self._now())
        prev = self.heard.get(hb.node)
        if prev is None or received >= prev.received:
            self.heard[hb.node] = _Heard(hb.boot_id, hb.seq, hb.at, received)

    async def _follow(self, start: int) -> None:
        follower = self.bus.follow(subjects.STREAM_HEARTBEAT, m.HEARTBEAT_DECODER, start, who="liveness",
                                   on_skip=self._skipped)
        try:
            async for batch in follower.batches():
                for d in batch:
                    self._on_heartbeat(d.raw, d.event)
        finally:
            self._next_seq = max(self._next_seq, follower.last_seq + 1)

    def _bus_back(self) -> bool:
        """True once after each return of the bus (noticed down, or by its reconnect count)."""
        if not self.bus.connected:
            if not self._down:
                log.warning("liveness: the bus is down; judging no node until it is back")
            self._down = self._deaf = True
            return False
        reconnects = self.bus.reconnects
        if reconnects == self._reconnects and not self._down:
            return False
        self._reconnects, self._down = reconnects, False
        self.outages += 1
        self._deaf = True
        self.started = self._now()
        return True

    # --- judging ------------------------------------------------------------------------------

    async def check(self) -> list[m.NodeLost | m.NodeReturned]:
        """Publish what changed since the last check; returns the events published."""
        if not self.bus.connected:
            return []  # a NodeLost judged now would reach the stream, late, after the bus returns
        now = self._now()
        out: list[m.NodeLost | m.NodeReturned] = []
        limit = timedelta(seconds=self.timeout_s)
        for node, heard in sorted(self.heard.items()):
            key = f"{heard.boot_id}:{heard.seq}"
            lost = self.lost.get(node)
            since = heard.received if self.started is None else max(heard.received, self.started)
            silent = now - since > limit
            fresh = now - heard.received <= limit  # a return needs a heartbeat, not just a grace period
            if silent and lost is None:
                ev_lost = m.NodeLost(at=now, node=node, last_heartbeat_at=heard.at, timeout_s=self.timeout_s)
                ack = await self.bus.publish(ev_lost, msg_id=f"NodeLost:{node}:{key}")
                self.lost[node] = _Lost(key=key, stream_seq=ack.seq)
                out.append(ev_lost)
            elif fresh and lost is not None and lost.key != key:
                ev_back = m.NodeReturned(at=now, node=node, boot_id=heard.boot_id)
                await self.bus.publish(ev_back, msg_id=f"NodeReturned:{node}:{lost.stream_seq}")
                del self.lost[node]
                out.append(ev_back)
        self.published.extend(out)
        return out

    async def run(self) -> None:
        """Follow and judge until cancelled."""
        self.started = self._now()
        self._reconnects = self.bus.reconnects
        self._next_seq = 1
        await self._load_lost()
        follower = asyncio.create_task(self._follow(1), name="heartbeats")
        # Let the stored heartbeats arrive before judging, or every node would look silent.
        await asyncio.sleep(min(self.check_every_s, 1.0))
        self.ready.set()
        try:
            while True:
                if self._bus_back() or follower.done():
                    # A reader that lost its consumer with the server would take seconds to notice:
                    # read afresh from where it was, so the monitor hears again at once.
                    if follower.done() and not follower.cancelled() and (e := follower.exception()) is not None:
                        if not isinstance(e, BusError):
                            raise e  # a bug, not an outage: end the monitor loudly
                        log.warning("liveness: heartbeats: %s; reading again", e)
                        self._deaf, self.started = True, self._now()
                    follower.cancel()
                    await asyncio.wait([follower])  # unlike awaiting it, never swallows our own cancel
                    follower = asyncio.create_task(self._follow(self._next_seq), name="heartbeats")
                else:
                    try:
                        await self.check()
                    except BusError as e:
                        log.warning("liveness: %s; retrying", e)
                await asyncio.sleep(self.check_every_s)
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await follower
