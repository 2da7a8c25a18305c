"""A simulated NVML backend built from a fleet file node, with faults injected at run time.

It implements the same port as the real adapter, so a simulated agent runs
exactly the agent code a GPU node runs; only the driver is pretend.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from llmgw.fleetfile import FleetNode
from llmgw.nvml import GPU_LOST, THERMAL, Finding, GpuEvent, GpuStatic, ecc_finding

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
