"""The node agent: GPU inventory and health from an NVML port, published as events.

* An inventory (every GPU, health included) at start and whenever the
  GPUs themselves change, or once its engines have said their versions
  (``vllm --version`` takes long: it never holds back the heartbeats); a
  restarted agent has a new boot id and publishes a fresh one, which replaces
  the node downstream.
* ``GpuHealthChanged`` only when a GPU's (healthy, reasons) changes.
* A critical XID arrives once, as a driver event; before its first inventory
  the agent reads what its node last published (the fleet stream), so a GPU
  that fell off the bus stays fenced across agent restarts until it is cleared.
* Heartbeats by core publish to the heartbeat stream, never to history; each
  carries every GPU's last sample (utilization, memory, temperature, power,
  processes), taken by its own loop so a driver call that hangs never stops one.
* Events go through a bounded outbox, so a NATS outage delays them but loses
  and doubles nothing: each carries a msg id of node, boot id and sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.agent.nvml import (
    Finding,
    GpuEvent,
    GpuStatic,
    GpuUse,
    NvmlPort,
    assess,
    gpu_class,
    xid_finding,
)
from llmgw.agent.simnvml import SimNvml
from llmgw.agent.supervisor import EngineSupervisor
from llmgw.bus import Bus, Outbox
from llmgw.errors import BusError, NvmlError, OutboxFullError, PublishError
from llmgw.fleetfile import FAULT_KINDS, FaultSpec, Fleet, faults

log = logging.getLogger(__name__)

Service = Callable[[Bus, Outbox], Awaitable[None]]
Health = tuple[bool, tuple[str, ...]]

_INJECT_DECODER = msgspec.json.Decoder(m.InjectFault)
_XID_REASON = re.compile(r"xid (\d{1,6}): ")
HEARTBEAT_PROCESSES = 16  # per GPU on a heartbeat, the largest first: enough to see who holds it


def _within(value: float | None, lo: float, hi: float) -> float | None:
    """A reading inside its bounds, else unknown: a driver's sentinel is not a figure."""
    return value if value is not None and lo <= value <= hi else None


def gpu_sample(use: GpuUse) -> m.GpuSample:
    """A driver's sample as the heartbeat carries it: every figure inside the schema's bounds."""
    procs = sorted(((pid, _within(mib, 0, m.MIB_MAX)) for pid, mib in use.processes if 1 <= pid <= 1 << 22),
                   key=lambda p: -(p[1] or 0))[:HEARTBEAT_PROCESSES]
    power = _within(use.power_w, 0, 10_000)
    return m.GpuSample(
        index=use.index,
        utilization_pct=_int(_within(use.utilization_pct, 0, 100)),
        memory_used_mib=_int(_within(use.memory_used_mib, 0, m.MIB_MAX)),
        memory_total_mib=_int(_within(use.memory_total_mib, 0, m.MIB_MAX)),
        temperature_c=_int(_within(use.temperature_c, -60, 200)),
        power_w=None if power is None else round(power, 1),
        processes=tuple(m.GpuProcess(pid=pid, used_mib=_int(mib)) for pid, mib in procs),
    )


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


@runtime_checkable
class FaultInjectable(Protocol):
    """A port whose GPUs can be made to fail on purpose (the simulator)."""

    def inject(self, gpu: int, kind: str, xid: int = 0) -> None: ...


# --- fabric ---------------------------------------------------------------------------


def infiniband_subnet(sysfs_root: Path = Path("/sys")) -> str:
    """The subnet prefix of the first active InfiniBand port (GID 0), or ""."""
    prefixes = []
    for port in sorted((sysfs_root / "class" / "infiniband").glob("*/ports/*")):
        layer = port / "link_layer"
        with contextlib.suppress(OSError):
            if layer.exists() and layer.read_text().strip() != "InfiniBand":
                continue  # RoCE ports have GIDs too, but an Ethernet subnet is not an IB fabric
        try:
            gid = (port / "gids" / "0").read_text().strip()
        except OSError:
            continue
        groups = gid.split(":")
        if len(groups) != 8 or not any(int(g or "0", 16) for g in groups):
            continue
        prefixes.append("".join(groups[:4]))
    return prefixes[0] if prefixes else ""


def detect_fabric(node: str, flag: str | None, gpus: Sequence[GpuStatic], sysfs_root: Path = Path("/sys")) -> tuple[str, str]:
    """(fabric, source): the flag, else NVLink fabric, else InfiniBand, else one named after the node."""
    if flag:
        return flag, "flag"
    cliques = sorted({(g.fabric_cluster_uuid, g.fabric_clique_id) for g in gpus if g.fabric_cluster_uuid})
    if cliques:
        cluster, clique = cliques[0]
        return f"nvl-{cluster}-{clique}", "nvml-fabric"
    subnet = infiniband_subnet(sysfs_root)
    if subnet:
        return f"ib-{subnet}", "infiniband"
    return node, "default"


# --- the agent --------------------------------------------------------------------------


class Agent:
    """One node's agent over an open NVML port; ``run`` until ``stop``."""

    def __init__(
        self,
        bus: Bus,
        port: NvmlPort,
        node: str,
        *,
        fabric: str | None = None,
        fabric_source: str = "flag",
        simulated: bool = False,
        heartbeat_s: float = 10.0,
        poll_s: float = 5.0,
        outbox_max: int = 10_000,
        sysfs_root: Path = Path("/sys"),
        services: Sequence[Service] = (),
        faults: Sequence[FaultSpec] = (),
        boot_id: str | None = None,
        now: Callable[[], datetime] = m.utcnow,
    ) -> None:
        self.bus, self.port, self.node = bus, port, node
        self.fabric_flag = fabric
        self.fabric, self.fabric_source = fabric or "", fabric_source
        self.simulated = simulated
        self.heartbeat_s, self.poll_s = heartbeat_s, poll_s
        self.sysfs_root = sysfs_root
        self.services = tuple(services)
        self.faults = tuple(f for f in faults if f.node == node)
        self.boot_id = boot_id or uuid.uuid4().hex[:16]
        self._now = now
        # An agent speaks only for its node: refused, it cannot do its job (another node's login, or none).
        self.outbox = bus.outbox(outbox_max, refusal_is_fatal=True)
        self.inventory: m.NodeInventoryReported | None = None
        self._engine_versions: dict[str, str] = {}  # engine -> what its --version says (EngineSupervisor.versions)
        self.started = asyncio.Event()
        self._stop = asyncio.Event()
        self._lock = asyncio.Lock()
        self._static: list[GpuStatic] = []
        self._sticky: dict[int, dict[str, Finding]] = {}
        self._published: dict[int, Health] = {}
        self._seq = 0
        self._events: asyncio.Queue[GpuEvent] = asyncio.Queue()
        self._events_applied = 0
        self._applied = asyncio.Condition()
        self._driver = ""
        # What this node last published per GPU uuid (any boot), until the first inventory uses it.
        self._remembered: dict[str, tuple[str, ...]] = {}
        # The GPUs' last samples, and when (monotonic) they were taken: what heartbeats carry.
        self.samples: tuple[m.GpuSample, ...] = ()
        self._sampled_at = 0.0
        self._first_sample = asyncio.Event()
        for svc in self.services:
            if isinstance(svc, EngineSupervisor):
                svc.memory_of = self.engine_memory
                if isinstance(port, SimNvml):
                    port.engines = svc.holds  # the simulated driver sees the fake engines' memory

    # --- state ------------------------------------------------------------------------

    def health(self, index: int) -> Health:
        """The last (healthy, reasons) this agent published for a GPU."""
        return self._published.get(index, (True, ()))

    def _put(self, event: m.Event) -> None:
        self._seq += 1
        self.outbox.put(event, msg_id=f"{type(event).__name__}:{self.node}:{self.boot_id}:{self._seq}")

    def _read(self) -> tuple[list[GpuStatic], dict[int, list[Finding]]]:
        static = self.port.gpus(self._static)
        return static, {g.index: self.port.health(g.index) for g in static}

    async def check(self) -> list[m.Event]:
        """Read the GPUs; queue an inventory if they changed, else the health transitions."""
        async with self._lock:
            static, findings = await asyncio.to_thread(self._read)
            if self._remembered:
                self._carry_over(static)
            health = {
                g.index: assess([*findings.get(g.index, []), *self._sticky.get(g.index, {}).values()])
                for g in static
            }
            now = self._now()
            if static != self._static:
                if self.fabric_flag is None:
                    self.fabric, self.fabric_source = detect_fabric(self.node, None, static, self.sysfs_root)
                inv = self._inventory_event(static, health, now)
                self._put(inv)
                self._static, self._published, self.inventory = static, dict(health), inv
                return [inv]
            events: list[m.Event] = []
            for g in static:
                if self._published.get(g.index) == health[g.index]:
                    continue
                healthy, reasons = health[g.index]
                ev = m.GpuHealthChanged(
                    at=now, node=self.node, gpu_index=g.index, gpu_uuid=g.uuid,
                    healthy=healthy, reasons=reasons, boot_id=self.boot_id,
                )
                self._put(ev)
                self._published[g.index] = health[g.index]
                events.append(ev)
            return events

    def _inventory_event(self, static: list[GpuStatic], health: dict[int, Health], now: datetime) -> m.NodeInventoryReported:
        return m.NodeInventoryReported(
            at=now,
            node=self.node,
            fabric=self.fabric,
            fabric_source=self.fabric_source,
            boot_id=self.boot_id,
            driver_version=self._driver,
            simulated=self.simulated,
            vllm_version=self._engine_versions.get("vllm", ""),
            llamacpp_version=self._engine_versions.get("llama.cpp", ""),
            gpus=tuple(
                m.GpuInfo(
                    index=g.index, uuid=g.uuid, name=g.name, gpu_class=gpu_class(g.name, g.memory_mib),
                    memory_mib=g.memory_mib, pci_bus_id=g.pci_bus_id, mig_enabled=g.mig_enabled,
                    nvlink_active_links=g.nvlink_active_links, fabric_cluster_uuid=g.fabric_cluster_uuid,
                    healthy=health[g.index][0], reasons=health[g.index][1],
                )
                for g in static
            ),
        )

    # --- what the node's previous agent published ------------------------------------------

    def _recall(self, event: m.Event) -> None:
        match event:
            case m.NodeInventoryReported(node=node) if node == self.node:
                self._remembered = {g.uuid: g.reasons for g in event.gpus}  # a full account
            case m.GpuHealthChanged(node=node) if node == self.node:
                self._remembered[event.gpu_uuid] = event.reasons
            case _:
                pass

    async def remember(self, within_s: float = 10.0) -> None:
        """Read this node's inventories and health changes from the fleet stream, for ``_carry_over``.

        Only a fault that came as a driver event (an XID) is carried: nothing can read it
        again, whereas ECC counts, a lost GPU or its temperature are read afresh. A stream
        that cannot be read is a warning, never a reason not to start.
        """
        filters = [subjects.fleet(self.node, "inventory"), subjects.fleet(self.node, "health")]
        try:
            async with asyncio.timeout(within_s):
                last = await self.bus.stream_last_seq(subjects.STREAM_FLEET)
                if last == 0:
                    return
                async for batch in self.bus.reader(subjects.STREAM_FLEET, 1, stop_at=last,
                                                   filter_subjects=filters).batches():
                    for raw in batch:
                        try:
                            self._recall(m.FLEET_DECODER.decode(raw.data))
                        except m.DECODE_ERRORS:
                            continue  # the projector records it; here it only says nothing
        except (BusError, TimeoutError) as e:
            log.warning("%s: cannot read this node's last GPU health (%s); faults from before this start are "
                        "not carried over", self.node, e or f"no answer within {within_s:g}s")

    def _carry_over(self, static: list[GpuStatic]) -> None:
        """Make the XIDs this node last published sticky again, on whichever index each GPU has now."""
        for g in static:
            for reason in self._remembered.get(g.uuid, ()):
                if found := _XID_REASON.match(reason):
                    f = xid_finding(int(found.group(1)))
                    self._sticky.setdefault(g.index, {}).setdefault(f.code if f.fatal else "app-xid", f)
        self._remembered = {}

    def _apply(self, ev: GpuEvent) -> None:
        if ev.index < 0:
            if ev.kind == "xid":
                log.warning("%s: xid %d on a GPU NVML could not name; not attributed", self.node, ev.xid)
            return
        if ev.kind == "xid":
            f = xid_finding(ev.xid)
            # A critical XID sticks until the GPU is reset; the latest application XID replaces the previous one.
            self._sticky.setdefault(ev.index, {})[f.code if f.fatal else "app-xid"] = f
        elif ev.kind == "cleared":
            self._sticky.pop(ev.index, None)

    # --- loops ---------------------------------------------------------------------------

    def _watch(self, loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
        """The NVML event thread: block on the event set, hand events to the loop."""
        while not stop.is_set():
            try:
                ev = self.port.wait_event(250)
            except NvmlError as e:
                log.error("%s: %s", self.node, e)
                stop.wait(5)
                continue
            if ev is not None and not stop.is_set():
                with contextlib.suppress(RuntimeError):  # the loop closed under us
                    loop.call_soon_threadsafe(self._events.put_nowait, ev)

    async def _consume(self) -> None:
        while True:
            ev = await self._events.get()
            self._apply(ev)
            await self._guarded_check()
            async with self._applied:
                self._events_applied += 1
                self._applied.notify_all()

    async def _guarded_check(self) -> None:
        try:
            await self.check()
        except NvmlError as e:
            log.error("%s: %s; retrying in %.0fs", self.node, e, self.poll_s)
        except OutboxFullError as e:
            log.error("%s: %s; the change is published when NATS is back", self.node, e)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self._guarded_check()

    def _sample(self) -> tuple[m.GpuSample, ...]:
        out = []
        for g in self._static:
            use = self.port.sample(g.index)
            if use is not None:
                out.append(gpu_sample(use))
        return tuple(out)

    async def _sampler(self) -> None:
        """Sample every GPU once a heartbeat, in a thread: a hung driver call stalls samples, not liveness."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                self.samples = await asyncio.to_thread(self._sample)
                self._sampled_at = loop.time()
            except Exception as e:  # noqa: BLE001 - samples are for people; health and liveness go on
                log.warning("%s: GPU use not sampled: %s", self.node, e)
            self._first_sample.set()
            await asyncio.sleep(self.heartbeat_s)

    def _fresh_samples(self) -> tuple[m.GpuSample, ...]:
        """The last samples, unless the sampler has been stuck for several heartbeats."""
        fresh = asyncio.get_running_loop().time() - self._sampled_at <= 3 * self.heartbeat_s + 1
        return self.samples if fresh else ()

    async def engine_memory(self, pids: set[int], gpus: tuple[int, ...]) -> int:
        """MiB that NVML lists for these processes on these GPUs (an engine's observed memory); 0: none listed."""
        uses = await asyncio.to_thread(lambda: [self.port.sample(i) for i in gpus])
        return sum(mib for use in uses if use is not None for pid, mib in use.processes
                   if pid in pids and mib is not None and 0 <= mib <= m.MIB_MAX)

    async def _heartbeat(self) -> None:
        seq = 0
        subject = subjects.heartbeat(self.node)
        with contextlib.suppress(TimeoutError):  # the first beat carries samples, unless the driver hangs
            async with asyncio.timeout(min(self.heartbeat_s, 2.0)):
                await self._first_sample.wait()
        while True:
            seq += 1
            hb = m.HeartbeatSent(at=self._now(), node=self.node, boot_id=self.boot_id, seq=seq,
                                 gpus=self._fresh_samples())
            try:
                await self.bus.publish_core(subject, m.encode(hb))
            except PublishError as e:
                log.warning("%s: heartbeat %d not sent: %s", self.node, seq, e)
            await asyncio.sleep(self.heartbeat_s)

    async def _learn_versions(self, engines: EngineSupervisor) -> None:
        """Ask the engines their versions; one the last inventory lacks publishes the inventory again."""
        found = await engines.versions()
        if {**self._engine_versions, **found} == self._engine_versions:
            return
        self._engine_versions.update(found)
        try:
            await self.republish()
        except OutboxFullError as e:
            log.warning("%s: engine versions %s not published: %s; the next inventory carries them", self.node, found, e)

    async def republish(self) -> None:
        """The inventory again, as last published but for what it says of the node (engine versions)."""
        async with self._lock:
            if self.inventory is None:
                return  # the first inventory, when it comes, says it all
            inv = self._inventory_event(self._static, dict(self._published), self._now())
            self._put(inv)
            self.inventory = inv

    async def _schedule(self) -> None:
        """The fleet file's [[faults]] for this node, in time order."""
        t = 0.0
        plan: list[tuple[float, int, str, int]] = []
        for f in self.faults:
            plan.append((f.after_s, f.gpu, f.kind, f.xid))
            if f.clear_after_s is not None:
                plan.append((f.after_s + f.clear_after_s, f.gpu, "clear", 0))
        for at, gpu, kind, xid in sorted(plan):
            await asyncio.sleep(at - t)
            t = at
            await self.inject(gpu, kind, xid)

    # --- faults (simulated ports only) -----------------------------------------------------

    async def inject(self, gpu: int, kind: str, xid: int = 0) -> m.FaultInjected:
        """Inject a fault into the simulated port and wait until the agent has acted on it.

        On real NVML only ``clear`` is taken: the operator says the GPU was reset, so the
        XIDs this agent holds against it (remembered across restarts) are dropped.
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; use xid=N, ecc, lost, thermal or clear")
        if not isinstance(self.port, FaultInjectable):
            if kind != "clear":
                raise NvmlError(f"{self.node} runs on real NVML; faults can only be injected into --simulate "
                                "agents (`clear` works on both)")
            if gpu not in {g.index for g in self._static}:
                raise ValueError(f"{self.node} has no GPU {gpu}")
            return await self._clear(gpu)
        before = self.health(gpu)
        async with self._applied:
            target = self._events_applied + 1
        self.port.inject(gpu, kind, xid)
        if kind in ("xid", "ecc", "clear"):
            # These arrive as driver events, through the event thread, like on a real GPU.
            async with self._applied:
                async with asyncio.timeout(10):
                    await self._applied.wait_for(lambda: self._events_applied >= target)
        await self.check()
        healthy, reasons = self.health(gpu)
        return m.FaultInjected(node=self.node, gpu=gpu, kind=kind, healthy=healthy, reasons=reasons,
                               changed=(healthy, reasons) != before)

    async def _clear(self, gpu: int) -> m.FaultInjected:
        before = self.health(gpu)
        self._apply(GpuEvent(index=gpu, kind="cleared"))
        await self.check()
        healthy, reasons = self.health(gpu)
        return m.FaultInjected(node=self.node, gpu=gpu, kind="clear", healthy=healthy, reasons=reasons,
                               changed=(healthy, reasons) != before)

    async def _on_fault(self, data: bytes) -> bytes:
        cmd = _INJECT_DECODER.decode(data)
        if cmd.node != self.node:
            raise ValueError(f"this is the agent of {self.node}, not {cmd.node}")
        return m.encode(await self.inject(cmd.gpu, cmd.kind, cmd.xid))

    # --- run ---------------------------------------------------------------------------------

    async def run(self) -> None:
        """Publish the inventory, then watch, poll and heartbeat until ``stop``."""
        self._driver = await asyncio.to_thread(self.port.driver_version)
        # The planner plans for the engine versions this node really starts (an engine supervisor says
        # which): those known from before go in the first inventory; asking the others (vLLM: 10–25 s)
        # goes on beside the heartbeats, and an answer publishes the inventory again.
        engines = [svc for svc in self.services if isinstance(svc, EngineSupervisor)]
        for sup in engines:
            self._engine_versions.update(sup.known_versions())
        await self.remember()
        await self.check()
        loop = asyncio.get_running_loop()
        stop_thread = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(loop, stop_thread), name=f"nvml-events-{self.node}", daemon=True)
        watcher.start()
        tasks = [
            asyncio.create_task(self.outbox.run(), name="outbox"),
            asyncio.create_task(self._consume(), name="events"),
            asyncio.create_task(self._poll(), name="poll"),
            asyncio.create_task(self._sampler(), name="gpu-samples"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            *(asyncio.create_task(_as_coro(svc(self.bus, self.outbox)), name="service") for svc in self.services),
        ]
        if self.faults:
            tasks.append(asyncio.create_task(self._schedule(), name="fault-schedule"))
        # Not among the tasks the agent lives by: a probe that has answered ends, the agent goes on.
        probes = [asyncio.create_task(self._learn_versions(sup), name="engine-versions") for sup in engines]
        # Simulated agents take every fault; real ones only an operator's `clear` after a GPU reset.
        sub: Any = await self.bus.serve(subjects.agent_fault(self.node), self._on_fault)
        self.started.set()
        try:
            stopped = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stopped and not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            with contextlib.suppress(PublishError):
                await self.outbox.flush(timeout=5)
        finally:
            stop_thread.set()
            for t in [*tasks, *probes]:
                t.cancel()
            await asyncio.gather(*tasks, *probes, return_exceptions=True)
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            await asyncio.to_thread(watcher.join, 2)

    def stop(self) -> None:
        self._stop.set()


async def _as_coro(aw: Awaitable[None]) -> None:
    await aw


def simulated_agents(bus: Bus, fleet: Fleet, nodes: Sequence[str] = (), *, fabric: str | None = None, **kw: Any) -> list[Agent]:
    """One agent per node of a fleet file (or the named ones) over the simulated backend, faults scheduled."""
    schedule = faults(fleet)
    chosen = [fleet.node(n) for n in nodes] if nodes else list(fleet.nodes)
    return [
        Agent(bus, SimNvml(n), n.name, fabric=fabric or n.fabric, fabric_source="flag" if fabric else "fleet-file",
              simulated=True, faults=schedule, **kw)
        for n in chosen
    ]
