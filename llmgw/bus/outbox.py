"""A bounded queue of events, delivered in order and exactly once across server outages."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmgw import messages as m
from llmgw import subjects
from llmgw.errors import (
    OutboxFullError,
    PermissionDeniedError,
    PublishError,
)

if TYPE_CHECKING:
    from llmgw.bus.connection import Bus

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    subject: str
    payload: bytes
    msg_id: str


class Outbox:
    """A bounded queue of events, delivered in order and exactly once.

    ``put`` never blocks and never talks to the network; ``run`` drains the
    queue, retrying each event with its own ``Nats-Msg-Id`` until the server
    acknowledges it, however long the outage. When the queue is full, ``put``
    raises OutboxFullError: the caller decides, nothing is dropped silently.
    """

    def __init__(self, bus: Bus, maxlen: int, *, refusal_is_fatal: bool = False) -> None:
        self.bus = bus
        self.maxlen = maxlen
        # A publisher that speaks only for itself (an agent for its node) cannot do its job once
        # NATS refuses it: ``run`` and ``flush`` raise the refusal instead of dropping the event.
        self.refusal_is_fatal = refusal_is_fatal
        self.failed: PermissionDeniedError | None = None
        self._queue: deque[_Pending] = deque()
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.delivered = 0
        self.duplicates = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, event: m.Event, *, msg_id: str | None = None) -> None:
        if len(self._queue) >= self.maxlen:
            raise OutboxFullError(
                f"the outbox holds {self.maxlen} undelivered events; NATS has been unreachable too long"
            )
        payload = m.encode(event)
        self._queue.append(_Pending(subjects.subject_for(event), payload, msg_id or subjects.msg_id(event, payload)))
        self._idle.clear()
        self._ready.set()

    async def run(self) -> None:
        """Deliver forever; cancel to stop (what is queued stays queued)."""
        while True:
            if not self._queue:
                self._idle.set()
                self._ready.clear()
                await self._ready.wait()
                continue
            item = self._queue[0]
            try:
                ack = await self.bus.publish_bytes(item.subject, item.payload, item.msg_id, timeout=None)
            except PermissionDeniedError as e:
                if self.refusal_is_fatal:
                    self.failed = e
                    self._idle.set()  # a flush waits no longer: it raises
                    raise
                # It can never succeed, and retrying would block everything behind it.
                log.error("outbox: %s; dropping that event", e)
                self._queue.popleft()
                self.refused += 1
                continue
            except PublishError as e:
                log.warning("outbox: %s", e)
                await asyncio.sleep(1.0)
                continue
            self._queue.popleft()
            self.delivered += 1
            self.duplicates += ack.duplicate

    async def flush(self, timeout: float = 10.0) -> None:  # noqa: ASYNC109 - public API
        """Wait until everything queued is acknowledged."""
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError as e:
            raise PublishError(f"{len(self._queue)} events still undelivered after {timeout:.0f}s") from e
        if self.failed is not None:
            raise self.failed
