"""Engines that share a GPU start one at a time.

vLLM measures the card's free memory when it starts (its profiling run) and sizes its KV
cache from it: two vLLMs profiling the same card at once each count the other's memory as
free, and both fail. So on a node, an engine whose GPUs another engine is still starting on
waits until that one is healthy, has failed, has stopped or has given up its start; or
until ``EngineConfig.share_wait_s`` has passed (by default its health timeout: an engine
not healthy by then is stopped and reported anyway, so a longer wait never helps, and
a shorter one would let two engines profile one card in the common case of a slow load).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class StartTurns:
    """Who is starting on which of this node's GPUs; a run takes its turn before it starts."""

    def __init__(self) -> None:
        self._starting: dict[str, tuple[int, ...]] = {}  # replica id → its GPU indexes here
        self._changed = asyncio.Event()

    def ahead(self, replica_id: str, gpus: tuple[int, ...]) -> tuple[str, int] | None:
        """The replica starting on one of ``gpus`` (and which GPU), or None when none is."""
        mine = set(gpus)
        for other, theirs in self._starting.items():
            if other != replica_id and (common := mine.intersection(theirs)):
                return other, min(common)
        return None

    async def take(self, replica_id: str, gpus: tuple[int, ...], limit_s: float,
                   waiting: Callable[[str, int], None]) -> str:
        """Wait until no other engine is starting on these GPUs, then hold the turn until ``done``.

        ``waiting(rid, gpu)`` is told each time the run waits behind another. Returns "" or, when
        the wait ran past ``limit_s``, the sentence saying whom it starts beside.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        told: str | None = None
        late = ""
        while (first := self.ahead(replica_id, gpus)) is not None:
            if first[0] != told:
                told = first[0]
                waiting(*first)
            left = deadline - loop.time()
            if left <= 0:
                late = (f"{first[0]} did not finish starting on GPU {first[1]} within {limit_s:g}s; "
                        "starting beside it")
                log.warning("engine %s: %s", replica_id, late)
                break
            changed = self._changed
            try:
                async with asyncio.timeout(left):
                    await changed.wait()
            except TimeoutError:
                continue  # judged again above: still there, past the limit
        self._starting[replica_id] = gpus
        return late

    def done(self, replica_id: str) -> None:
        """The run's start is over (healthy, failed, stopped or given up): the next may start."""
        if self._starting.pop(replica_id, None) is not None:
            self._changed.set()
            self._changed = asyncio.Event()  # the next change wakes the next waiters
