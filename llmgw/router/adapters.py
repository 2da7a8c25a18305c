"""LoRA adapters in the router: a request naming an adapter goes to a replica of its base that holds it.

* **llama.cpp** replicas attach every adapter of their base at start (``--lora``, in the
  order of their spec: the adapter's id); the router sends the request there with the
  body's ``lora`` set to that adapter at its scale and every other attached one at 0 —
  always the complete list, since llama-server reuses a prompt cache computed under
  other scales when a request leaves some out. A replica placed before the adapter was
  declared (a roll in progress) does not hold it and is never chosen.
* **vLLM** replicas load adapters at runtime (``POST /v1/load_lora_adapter``, the engine
  started with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``). A replica holding it, the least busy
  first; none does: the least busy replica of the base loads it while the request is held,
  as a wake holds one, after unloading its least recently used adapter when it holds
  ``max_adapters`` already. Concurrent requests for one adapter wait on one load. What a
  replica holds is learned from its engine (``GET /v1/models``) the first time, so a
  restarted router or another router's loads are never guessed at; each load and unload
  is published (``AdapterLoaded``/``AdapterUnloaded``) so status, replay and what-if see it.

A request is never sent to a replica that does not hold its adapter.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.engine.upstream import Upstream
from llmgw.fleet.pool import Adapter, Pool, Replica
from llmgw.router.openai_api import with_field

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 120.0  # an adapter read from a slow disk; the request waits at most this long
_JSON = {"Content-Type": "application/json"}
_MODELS = msgspec.json.Decoder(dict[str, object])


@dataclass(frozen=True)
class Chosen:
    """A replica taken for an adapter's request, and the body to send it (rewritten for llama.cpp)."""

    replica: Replica
    body: bytes
    loaded_s: float = 0.0  # the load this request waited for (0: it was held already)


class AdapterError(Exception):
    """Why an adapter's request cannot be served now: (status, code, sentence)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class Adapters:
    """What this router knows of adapters: which vLLM replica holds which, and the loads under way."""

    def __init__(self, *, bus: Bus, name: str, pool: Pool, upstream: Upstream,
                 take: Callable[[Replica], Replica]) -> None:
        self.bus, self.name, self.pool, self.upstream = bus, name, pool, upstream
        self._take = take  # the gateway's: counts the request on the replica (outstanding, idle time)
        # Per vLLM replica, its adapters by last use (oldest first); None until its engine was asked.
        self.held: dict[str, OrderedDict[str, float]] = {}
        self._loads: dict[tuple[str, str], asyncio.Future[float]] = {}
        self._asking: dict[str, asyncio.Future[None]] = {}
        # Requests in flight per (replica, adapter): an adapter in use is never the one unloaded.
        self.busy: dict[tuple[str, str], int] = {}
        self._freed = asyncio.Event()  # set whenever a request is done with an adapter
        self.loads = self.unloads = 0
        self.missing = 0  # requests an engine answered 404 for: it did not hold the adapter sent to it

    def finished(self, replica_id: str, name: str) -> None:
        """A request ``choose`` gave ``replica_id`` for ``name`` is done."""
        key = (replica_id, name)
        left = self.busy.get(key, 0) - 1
        if left > 0:
            self.busy[key] = left
        else:
            self.busy.pop(key, None)
            self._freed.set()

    def _hold(self, rep: Replica, name: str) -> Replica:
        """Take ``rep`` for a request of ``name``: counted on the replica, and ``name`` in use there from
        now, before any await, so that no load beside it unloads the adapter it is about to use."""
        key = (rep.replica_id, name)
        self.busy[key] = self.busy.get(key, 0) + 1
        return self._take(rep)

    def _unhold(self, rep: Replica, name: str) -> None:
        rep.outstanding -= 1
        self.finished(rep.replica_id, name)

    async def choose(self, name: str, adapter: Adapter, body: bytes, exclude: Replica | None = None,
                     lora_sent: bool = True) -> Chosen | None:
        """A replica of the base holding ``name`` (loaded there first if need be), taken, and the request
        counted as using ``name`` there until ``finished``; None: no replica of the base is healthy (the
        caller wakes it). AdapterError when it cannot be served at all."""
        reps = [r for r in self.pool.healthy.get(adapter.base, ()) if r is not exclude]
        if not reps:
            return None
        engine = self.pool.declared[adapter.base].engine if adapter.base in self.pool.declared else ""
        if engine == "llama.cpp" or any(r.adapters for r in reps):
            holders = [r for r in reps if name in r.adapters]
            if not holders:
                raise AdapterError(503, "adapter_not_attached",
                                   f"no healthy replica of {adapter.base} has adapter {name!r} attached yet (its "
                                   "replicas roll to attach it); retry shortly")
            rep = min(holders, key=lambda r: r.outstanding)
            return Chosen(self._hold(rep, name), lora_body(body, rep.adapters, name, adapter.scale, lora_sent))
        if len(self.held) > 2 * len(self.pool.replicas) + 16:
            self.drop_gone()  # stopped replicas' entries: bounded by the pool, not by every replica ever run
        for rep in reps:
            if rep.replica_id not in self.held:
                await self._learn(rep)
        holders = [r for r in reps if name in self.held.get(r.replica_id, ())]
        if holders:
            rep = min(holders, key=lambda r: r.outstanding)
            self.held[rep.replica_id].move_to_end(name)
            self.held[rep.replica_id][name] = time.time()
            return Chosen(self._hold(rep, name), body)
        pending = next(((rid, fut) for (rid, a), fut in self._loads.items() if a == name), None)
        if pending is not None:  # being loaded already: wait for that one, on that replica
            rid, fut = pending
            loading = next((r for r in reps if r.replica_id == rid), None)
            if loading is not None:
                took = self._hold(loading, name)
                try:
                    await asyncio.shield(fut)
                    return Chosen(took, body)  # the load's time is the answer of the request that made it
                except BaseException:
                    self._unhold(loading, name)
                    raise
        rep = min(reps, key=lambda r: (r.outstanding, len(self.held.get(r.replica_id, ()))))
        took = self._hold(rep, name)  # counted while it loads: the next request sees it busy
        try:
            waited = await self._load(rep, name, adapter)
        except BaseException:
            self._unhold(rep, name)
            raise
        return Chosen(took, body, waited)

    async def _learn(self, rep: Replica) -> None:
        """What a vLLM replica's engine holds, from its /v1/models (adapters list their base as parent);
        asked once, however many requests arrive meanwhile."""
        asking = self._asking.get(rep.replica_id)
        if asking is not None:
            await asyncio.shield(asking)
            return
        asking = self._asking[rep.replica_id] = asyncio.get_running_loop().create_future()
        try:
            await self._ask(rep)
        finally:
            asking.set_result(None)
            del self._asking[rep.replica_id]

    async def _ask(self, rep: Replica) -> None:
        held: OrderedDict[str, float] = OrderedDict()
        try:
            async with self.upstream.get(rep.endpoint, "/v1/models", total_s=10) as resp:
                data = _MODELS.decode(await resp.read()) if resp.status == 200 else {}
            listed = data.get("data")
            for entry in listed if isinstance(listed, list) else ():
                if isinstance(entry, dict) and entry.get("parent") and isinstance(entry.get("id"), str):
                    held[entry["id"]] = 0.0
        except (OSError, TimeoutError, msgspec.DecodeError) as e:
            log.warning("router %s: cannot ask %s (%s) which adapters it holds (%s); assuming none",
                        self.name, rep.replica_id, rep.endpoint, e)
        self.held[rep.replica_id] = held

    async def _load(self, rep: Replica, name: str, adapter: Adapter) -> float:
        key = (rep.replica_id, name)
        running = self._loads.get(key)
        if running is not None:
            return await asyncio.shield(running)
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._loads[key] = fut
        try:
            took = await self._load_now(rep, name, adapter)
            fut.set_result(took)
            return took
        except BaseException as e:
            fut.set_exception(e if isinstance(e, Exception) else AdapterError(503, "adapter_load_failed", str(e)))
            fut.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        finally:
            self._loads.pop(key, None)

    async def _load_now(self, rep: Replica, name: str, adapter: Adapter) -> float:
        held = self.held.setdefault(rep.replica_id, OrderedDict())
        limit = self.pool.declared[adapter.base].max_adapters if adapter.base in self.pool.declared else 0
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while limit and len(held) >= limit:
            # The least recently used that no request is using; while every one is in use, wait for one
            # to be done (bounded): a name past the engine's slots and its weight cache makes vLLM read
            # adapters from disk again and again.
            oldest = next((a for a in held if not self.busy.get((rep.replica_id, a))), None)
            if oldest is None:
                self._freed.clear()
                try:
                    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                        await self._freed.wait()
                except TimeoutError:
                    raise AdapterError(503, "adapter_slots_busy",
                                       f"every adapter slot of {rep.replica_id} stayed in use for "
                                       f"{LOAD_TIMEOUT_S:g}s; retry shortly") from None
                continue
            held.pop(oldest, None)  # first: a request arriving meanwhile must not be sent to it
            await self._call(rep, "/v1/unload_lora_adapter", {"lora_name": oldest}, ok_also=(404,))
            self.unloads += 1
            await self._publish(m.AdapterUnloaded(at=m.utcnow(), router=self.name, replica_id=rep.replica_id,
                                                  adapter=oldest, reason=f"least recently used; {name} needed room"))
        t0 = time.perf_counter()
        await self._call(rep, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": adapter.path},
                         ok_also=(400,))  # 400: already loaded (another router, a restart): held all the same
        took = time.perf_counter() - t0
        held[name] = time.time()
        self.loads += 1
        await self._publish(m.AdapterLoaded(at=m.utcnow(), router=self.name, replica_id=rep.replica_id,
                                            adapter=name, load_s=round(took, 4)))
        return took

    async def _call(self, rep: Replica, route: str, body: dict[str, str], ok_also: tuple[int, ...] = ()) -> None:
        try:
            async with asyncio.timeout(LOAD_TIMEOUT_S):
                async with self.upstream.post(rep.endpoint, route, msgspec.json.encode(body), dict(_JSON)) as resp:
                    text = (await resp.read())[:500].decode(errors="replace")
        except (OSError, TimeoutError) as e:
            raise AdapterError(502, "adapter_load_failed",
                               f"replica {rep.replica_id} could not be reached to {route.rsplit('/', 1)[1]} "
                               f"({type(e).__name__}); retry shortly") from e
        if resp.status != 200 and resp.status not in ok_also:
            raise AdapterError(502, "adapter_load_failed",
                               f"replica {rep.replica_id} refused {route} for {body['lora_name']!r} "
                               f"({resp.status}: {' '.join(text.split())[:300]})")

    def forget(self, rep: Replica, name: str) -> None:
        """The engine said it does not hold ``name`` (another router unloaded it): load it again next time."""
        self.missing += 1
        held = self.held.get(rep.replica_id)
        if held is not None:
            held.pop(name, None)

    def drop_gone(self) -> None:
        """Forget replicas that left the pool (called as the pool changes)."""
        for rid in [r for r in self.held if r not in self.pool.replicas]:
            del self.held[rid]

    async def _publish(self, event: m.Event) -> None:
        try:
            await self.bus.publish(event, timeout=5)
        except Exception as e:  # the record is lost, never the request
            log.warning("router %s: could not publish %s (%s)", self.name, type(event).__name__, e)


def lora_body(body: bytes, attached: tuple[str, ...], name: str, scale: float, present: bool = True) -> bytes:
    """The request with llama-server's ``lora`` field: ``name`` at ``scale``, every other attached adapter at 0.

    ``present``: the body may hold a ``lora`` already (the client's, or one set before a
    retry); without one, the field is put in without parsing the body (``openai_api.with_field``).
    """
    value = msgspec.json.encode([{"id": i, "scale": scale if a == name else 0.0} for i, a in enumerate(attached)])
    return with_field(body, "lora", value, present)
