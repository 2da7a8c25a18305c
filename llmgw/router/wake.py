"""Only while a model is parked: the requests held for it, the wish that wakes it, the ledger's router side.

A request for a declared model with no healthy replica, parked or starting, is held
here until the pool says the model serves or cannot (``pool_changed``, the sink's
callback), or until the wake timeout. Holding publishes ``ModelWanted``, at most once
per model per tick, and each tick asks again while the model stays parked (a wish may
be lost, a scheduler may have been away); the scheduler decides from the fold. The
held request then goes on through the gateway like any other, and ``ledger``
(``WakeLog``) notes when it went on and when its first byte came back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.errors import LlmgwError
from llmgw.router.endpoints import EndpointSink, Pool
from llmgw.router.idle import IdleTracker
from llmgw.router.metrics import Metrics
from llmgw.router.wakelog import WakeLog

log = logging.getLogger(__name__)


class Wake:
    """Held requests per model, the wishes for them, and the wakes they saw answered."""

    def __init__(self, *, bus: Bus, name: str, boot_id: str, pool: Pool, sink: EndpointSink, metrics: Metrics,
                 idle: IdleTracker, tick_s: float, timeout_s: float) -> None:
        self.bus = bus
        self.name = name
        self.boot_id = boot_id
        self.pool = pool
        self.sink = sink
        self.metrics = metrics
        self.idle = idle  # its tick count: one wish per model per tick
        self.tick_s = tick_s
        self.timeout_s = timeout_s
        # Requests held for a model with no healthy replica, oldest first, and the
        # tick of the last wish published for each model (one per model per tick).
        self.waiting: dict[str, list[asyncio.Future[str]]] = {}
        self._wished_at_tick: dict[str, int] = {}
        self.wishes = 0
        self.ledger = WakeLog()  # the cold-start ledger's router side, published with the idle maps
        self._tasks: set[asyncio.Task[None]] = set()

    def queued(self) -> dict[str, int]:
        """Per model, the requests held for it (the idle map's ``queued``)."""
        return {name: len(held) for name, held in self.waiting.items() if held}

    def wish(self, model: str) -> None:
        """Publish ``ModelWanted`` for a model, at most once per tick; never awaits."""
        if self._wished_at_tick.get(model) == self.idle.tick:
            return
        self._wished_at_tick[model] = self.idle.tick
        event = m.ModelWanted(at=m.utcnow(), router=self.name, boot_id=self.boot_id, model=model,
                              control_seq=self.sink.applied_seq, waiting=max(len(self.waiting.get(model, ())), 1))
        task = asyncio.create_task(self._publish_wish(event), name=f"router-wish-{model}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def wish_parked(self) -> None:
        """A tick's wish again for each model still parked with requests held; not while it starts."""
        for model in [name for name, held in self.waiting.items() if held and self.pool.model_state(name) == "parked"]:
            self.wish(model)

    async def _publish_wish(self, event: m.ModelWanted) -> None:
        try:
            await self.bus.publish(event, timeout=max(1.0, self.tick_s))
            self.wishes += 1
            self.metrics.wish(event.model)
        except LlmgwError as e:
            # The next tick publishes again while requests still wait.
            self._wished_at_tick.pop(event.model, None)
            log.warning("router %s: wish for %s not published: %s", self.name, event.model, e)

    def pool_changed(self) -> None:
        """Release held requests, oldest first, once their model serves or cannot wake."""
        for model, held in list(self.waiting.items()):
            state = self.pool.model_state(model)
            if state in ("parked", "starting"):
                continue
            for fut in held:
                if not fut.done():
                    fut.set_result(state)
            del self.waiting[model]

    async def hold(self, model: str) -> tuple[str, float]:
        """Hold a request until its model serves or cannot wake: (its state then, when the hold began).

        ``serving`` lets the request take a replica; anything else is why it cannot.
        """
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        held_since = time.time()
        held = self.waiting.setdefault(model, [])
        held.append(fut)
        self.wish(model)
        try:
            async with asyncio.timeout(self.timeout_s):
                state = await fut
        except TimeoutError:
            state = "timeout"
        finally:
            if fut in held:
                held.remove(fut)
            if not held and self.waiting.get(model) is held:
                del self.waiting[model]
        self.metrics.held(model, "served" if state == "serving" else state, time.time() - held_since)
        return state, held_since

    async def stop(self) -> None:
        """Every held request goes on as ``stopping``; the wishes still being published are cancelled."""
        for held in self.waiting.values():
            for fut in held:
                if not fut.done():
                    fut.set_result("stopping")
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
