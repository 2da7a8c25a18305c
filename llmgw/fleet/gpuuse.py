"""GPU use for status: the agents' latest samples, followed from the heartbeat stream, and summed up.

Heartbeats are not history (their stream keeps the latest per node), so GPU
use is live only: it is never folded, a replay has none, and it is joined to
the fold only when asked: a node the fold says is lost, a GPU it does not know,
or a sample older than ``max_age_s`` shows nothing rather than a stale figure;
nor does the memory of a GPU sampled before a replica on it stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC

import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus, RawMsg
from llmgw.errors import BusError, PermissionDeniedError
from llmgw.fleet.state import FleetState

log = logging.getLogger(__name__)

MAX_NODES = 100_000  # samples kept at most; past it a new node's are dropped and counted
# Nodes whose samples one status answer carries (~1 KiB each): the answer stays well under NATS's
# default 1 MiB payload limit on any fleet; per-class use always covers every node.
NODE_ROWS = 400


class GpuSamples:
    """The latest heartbeat of every node, followed from the heartbeat stream while ``run`` runs."""

    def __init__(self, bus: Bus, *, max_age_s: float = 120.0, max_nodes: int = MAX_NODES,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.bus = bus
        self.max_age_s = max_age_s
        self.max_nodes = max_nodes
        self._clock_ns = clock_ns
        self.latest: dict[str, tuple[int, m.HeartbeatSent]] = {}  # node → (stored at, ns; heartbeat)
        self.skipped = 0  # heartbeats that could not be decoded or named another node
        self.dropped = 0  # heartbeats of nodes past max_nodes
        self.following = asyncio.Event()
        self._next_seq = 1

    def take(self, raw: RawMsg, hb: m.HeartbeatSent) -> None:
        """Keep a heartbeat if it is the newest of its node."""
        known = self.latest.get(hb.node)
        if known is None and len(self.latest) >= self.max_nodes:
            self.dropped += 1
            return
        if known is None or raw.ts_ns >= known[0]:
            self.latest[hb.node] = (raw.ts_ns, hb)

    def fresh(self) -> dict[str, m.HeartbeatSent]:
        """Each node's heartbeat stored within ``max_age_s``."""
        oldest = self._clock_ns() - int(self.max_age_s * 1e9)
        return {node: hb for node, (ts, hb) in self.latest.items() if ts >= oldest}

    def _skip(self, raw: RawMsg, error: Exception) -> None:
        self.skipped += 1

    async def _follow(self) -> None:
        follower = self.bus.follow(subjects.STREAM_HEARTBEAT, m.HEARTBEAT_DECODER, self._next_seq,
                                   who="gpu use", on_skip=self._skip)
        try:
            async for batch in follower.batches():
                for d in batch:
                    self.take(d.raw, d.event)
                self.following.set()
        finally:
            self._next_seq = max(self._next_seq, follower.last_seq + 1)

    async def run(self) -> None:
        """Follow the heartbeat stream until cancelled; a bus outage is waited out, a refusal ends it."""
        delay = 0.5
        while True:
            try:
                await self._follow()
            except PermissionDeniedError as e:
                log.warning("GPU use: cannot read %s (%s); status shows no GPU use (give this user the "
                            "projector role of `llmgw nats-conf`)", subjects.STREAM_HEARTBEAT, e)
                return
            except BusError as e:
                log.warning("GPU use: reading %s: %s; again in %.1fs", subjects.STREAM_HEARTBEAT, e, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)


def summarize(state: FleetState, beats: Mapping[str, m.HeartbeatSent], *,
              nodes: bool = False) -> tuple[tuple[m.ClassGpuUse, ...], tuple[m.NodeGpus, ...]]:
    """Per GPU class (and, with ``nodes``, per node) what the samples of live, known GPUs say."""
    classes: dict[str, list[int]] = {}  # class → [sampled, util sum, util count, used, total]
    per_node: list[m.NodeGpus] = []
    for name, hb in sorted(beats.items()):
        node = state.nodes.get(name)
        if node is None or node.lost:
            continue
        kept = []
        for s in hb.gpus:
            gpu = node.gpus.get(s.index)
            if gpu is None:
                continue
            if s.memory_used_mib is not None and (freed := state.released.get(gpu.uuid)) is not None and hb.at < freed:
                # Sampled before a replica on it stopped: what it says held is gone; unknown until the next beat.
                s = msgspec.structs.replace(s, memory_used_mib=None, processes=())
            kept.append(s)
            c = classes.setdefault(gpu.gpu_class, [0, 0, 0, 0, 0])
            c[0] += 1
            if s.utilization_pct is not None:
                c[1] += s.utilization_pct
                c[2] += 1
            if s.memory_used_mib is not None and s.memory_total_mib is not None:
                c[3] += s.memory_used_mib
                c[4] += s.memory_total_mib
        if nodes and kept and len(per_node) < NODE_ROWS:
            kinds = {g.gpu_class for g in node.gpus.values()}
            per_node.append(m.NodeGpus(node=name, gpu_class=kinds.pop() if len(kinds) == 1 else "mixed",
                                       at=hb.at.astimezone(UTC),
                                       gpus=tuple(msgspec.structs.replace(s, processes=()) if s.processes else s
                                                  for s in kept),
                                       unhealthy={g.index: "; ".join(g.reasons) or "unhealthy"
                                                  for g in node.gpus.values() if not g.healthy}))
    use = tuple(
        m.ClassGpuUse(gpu_class=k, sampled=c[0], utilization_pct=round(c[1] / c[2], 1) if c[2] else None,
                      memory_used_mib=c[3], memory_total_mib=c[4])
        for k, c in sorted(classes.items())
    )
    return use, tuple(per_node)


def add_to(report: m.StatusReport, state: FleetState, samples: GpuSamples | None, *,
           nodes: bool = False) -> m.StatusReport:
    """The report with GPU use from the fresh samples (unchanged when nothing follows heartbeats)."""
    if samples is None or not samples.latest:
        return report
    use, per_node = summarize(state, samples.fresh(), nodes=nodes)
    return msgspec.structs.replace(report, gpu_use=use, node_gpus=per_node)


async def stop(task: asyncio.Task[None] | None) -> None:
    """Cancel a ``run`` task and wait for it to end.

    Again and again: Python 3.11's ``asyncio.wait_for`` inside nats-py can swallow a
    cancel that arrives as its inner await completes, and the follower would then
    read on, holding up the projector's stop (as ``runner._all_or_none`` does for reads).
    """
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
    if not task.cancelled():
        with contextlib.suppress(Exception):
            task.result()  # its outcome is read, so none is reported as never retrieved
