"""A simulated NVML backend built from a fleet file node, with faults injected at run time.

It implements the same port as the real adapter, so a simulated agent runs
exactly the agent code a GPU node runs; only the driver is pretend.
"""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from llmgw.agent.nvml import GPU_LOST, THERMAL, Finding, GpuEvent, GpuStatic, GpuUse, ecc_finding
from llmgw.fleetfile import FleetNode

# (pid, GPU indexes, MiB it holds on each): a fake engine as the driver would see its allocations.
Hold = tuple[int, tuple[int, ...], int]

IDLE_MIB = 4  # what nvidia-smi shows on an idle card
# Board power by class prefix, for plausible watts (the first that matches).
_TDP_W = (("B200", 1000), ("H200", 700), ("H100", 700), ("A100", 400), ("L40", 350), ("L4", 72))

FLEET_FILE_MARK = Finding("fleet-file", "marked unhealthy in the fleet file")


@dataclass
class _SimGpu:
    marked: bool = False
    ecc: int = 0
    lost: bool = False
    thermal: bool = False


class SimNvml:
    """The NVML port over a fleet file node; ``inject`` is the fault switch."""

    def __init__(self, node: FleetNode) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._gpus = [_SimGpu(marked=i in node.unhealthy) for i in range(node.gpu_count)]
        self._events: queue.Queue[GpuEvent] = queue.Queue()
        self.opened = False
        # The fake engines running on this node (the agent wires its engine supervisor here):
        # a GPU one of them holds is busy, every other idle.
        self.engines: Callable[[], Iterable[Hold]] | None = None
        self._samples = 0

    def open(self) -> None:
        self.opened = True

    def close(self) -> None:
        self.opened = False

    def driver_version(self) -> str:
        return "simulated"

    def gpus(self, previous: Sequence[GpuStatic] = ()) -> list[GpuStatic]:
        n = self.node
        return [
            GpuStatic(
                index=i,
                uuid=n.gpu_uuid(i),
                name=n.default_gpu_name(),
                memory_mib=n.gpu_memory_mib,
                pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
                # An HGX board: every GPU has 18 NVLinks to the NVSwitches; PCIe cards none.
                nvlink_active_links=18 if n.gpu_count == 8 and n.gpu_class.startswith(("H", "A100", "B")) else 0,
            )
            for i in range(n.gpu_count)
        ]

    def health(self, index: int) -> list[Finding]:
        with self._lock:
            g = self._gpus[index]
            if g.lost:
                return [GPU_LOST]
            out = []
            if g.marked:
                out.append(FLEET_FILE_MARK)
            if g.ecc:
                out.append(ecc_finding(g.ecc))
            if g.thermal:
                out.append(THERMAL)
            return out

    def wait_event(self, timeout_ms: int) -> GpuEvent | None:
        try:
            return self._events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            return None

    def sample(self, index: int) -> GpuUse | None:
        """Plausible figures: a GPU a fake engine holds is busy and full to its reservation, the rest idle."""
        with self._lock:
            g = self._gpus[index]
            if g.lost:
                return None
            thermal = g.thermal
            self._samples += 1
            n = self._samples
        total = self.node.gpu_memory_mib
        # An engine without a planned size takes what vLLM takes by default: 90% of the card.
        held = [(pid, mib if mib > 0 else total * 9 // 10)
                for pid, gpus, mib in (self.engines() if self.engines is not None else ()) if index in gpus]
        tdp = next((w for prefix, w in _TDP_W if self.node.gpu_class.startswith(prefix)), 300)
        if not held:
            return GpuUse(index=index, utilization_pct=0, memory_used_mib=IDLE_MIB, memory_total_mib=total,
                          temperature_c=92 if thermal else 31 + index % 4, power_w=round(tdp * 0.1, 1))
        # Deterministic per node, GPU and sample: busy, moving, never the same twice in a row.
        util = random.Random(f"{self.node.name}:{index}:{n}").randint(55, 97)
        used = min(total, IDLE_MIB + sum(mib for _, mib in held))
        return GpuUse(index=index, utilization_pct=util, memory_used_mib=used, memory_total_mib=total,
                      temperature_c=92 if thermal else 55 + util // 5,
                      power_w=round(tdp * (0.3 + 0.65 * util / 100), 1), processes=tuple(held))

    def inject(self, gpu: int, kind: str, xid: int = 0) -> None:
        """Make GPU ``gpu`` go bad the way a real one would show it; ``clear`` repairs it."""
        if not 0 <= gpu < self.node.gpu_count:
            raise ValueError(f"{self.node.name} has GPUs 0 to {self.node.gpu_count - 1}, not {gpu}")
        with self._lock:
            g = self._gpus[gpu]
            match kind:
                case "xid":
                    self._events.put(GpuEvent(index=gpu, kind="xid", xid=xid))
                case "ecc":
                    g.ecc += 1
                    self._events.put(GpuEvent(index=gpu, kind="ecc"))
                case "lost":
                    g.lost = True
                case "thermal":
                    g.thermal = True
                case "clear":
                    self._gpus[gpu] = _SimGpu()
                    self._events.put(GpuEvent(index=gpu, kind="cleared"))
                case _:
                    raise ValueError(f"unknown fault {kind!r}; use xid=N, ecc, lost, thermal or clear")
