"""A simulated NVML backend built from a fleet file node, with faults injected at run time.

It implements the same port as the real adapter, so a simulated agent runs
exactly the agent code a GPU node runs; only the driver is pretend.

A GPU's utilization follows the requests its engines have in flight, as the engines
themselves say on ``/metrics`` (found at the ``--port`` of the process's command line, the
one thing the driver knows of an engine: its pid): the fake engine's seconds with a request
in flight give NVML's own figure, the share of the last sample period the GPU was busy; a
real engine's ``vllm:num_requests_running`` (or llama.cpp's ``requests_processing``) gives
100 % while it runs any and 0 when it runs none. An idle engine's GPUs read 0 %, one whose
``/metrics`` does not answer reads unknown, never a made-up figure.
"""

from __future__ import annotations

import queue
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmgw.agent.nvml import GPU_LOST, THERMAL, Finding, GpuEvent, GpuStatic, GpuUse, ecc_finding
from llmgw.engine.argv import API_KEY_ENV, FAKE_API_KEY_ENV
from llmgw.fleetfile import FleetNode

# (pid, GPU indexes, MiB it holds on each): a fake engine as the driver would see its allocations.
Hold = tuple[int, tuple[int, ...], int]

IDLE_MIB = 4  # what nvidia-smi shows on an idle card
# Board power by class prefix, for plausible watts (the first that matches).
_TDP_W = (("B200", 1000), ("H200", 700), ("H100", 700), ("A100", 400), ("L40", 350), ("L4", 72))

FLEET_FILE_MARK = Finding("fleet-file", "marked unhealthy in the fleet file")

SCRAPE_TIMEOUT_S = 0.5  # an engine's /metrics, on this host
REUSE_S = 0.5  # one engine's GPUs sampled together share one read of its /metrics
_BUSY = re.compile(r"^llmgw_fake_busy_seconds_total\s+([0-9.eE+]+)\s*$", re.M)
_RUNNING = re.compile(r"^(?:vllm:num_requests_running|llamacpp:requests_processing)(?:\{[^}\n]*\})?\s+([0-9.eE+]+)\s*$",
                      re.M)


def metrics_url(pid: int) -> str | None:
    """Where the engine process ``pid`` serves /metrics: its command line's ``--host`` and ``--port``."""
    try:
        args = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    except OSError:
        return None
    flags = dict(zip(args, args[1:], strict=False))
    port, host = flags.get("--port", ""), flags.get("--host", "127.0.0.1")
    if not port.isdigit() or not 0 < int(port) < 65536:
        return None
    host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def engine_key(pid: int) -> str | None:
    """The API key the engine process ``pid`` was started with (its environment, as the agent set it)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    names = {*(n.encode() + b"=" for n in API_KEY_ENV.values()), FAKE_API_KEY_ENV.encode() + b"="}
    for item in env:
        name, eq, value = item.partition(b"=")
        if eq and name + b"=" in names and value:
            return value.decode(errors="replace")
    return None


def _number(pattern: re.Pattern[str], text: str) -> float | None:
    found = pattern.search(text)
    try:
        return float(found.group(1)) if found else None
    except ValueError:
        return None


@dataclass
class _Load:
    """An engine's last read: when (monotonic), its busy seconds then, and the utilization it gave."""

    at: float
    busy: float | None
    util: int | None


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
        self._loads: dict[int, _Load] = {}  # by engine pid

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
        total = self.node.gpu_memory_mib
        # An engine without a planned size takes what vLLM takes by default: 90% of the card.
        held = [(pid, mib if mib > 0 else total * 9 // 10)
                for pid, gpus, mib in (self.engines() if self.engines is not None else ()) if index in gpus]
        tdp = next((w for prefix, w in _TDP_W if self.node.gpu_class.startswith(prefix)), 300)
        if not held:
            return GpuUse(index=index, utilization_pct=0, memory_used_mib=IDLE_MIB, memory_total_mib=total,
                          temperature_c=92 if thermal else 31 + index % 4, power_w=round(tdp * 0.1, 1))
        # Engines sharing the card share its time: their shares add up, to at most the whole of it.
        shares = [u for u in (self.utilization(pid) for pid in {pid for pid, _ in held}) if u is not None]
        util = min(100, sum(shares)) if shares else None
        used = min(total, IDLE_MIB + sum(mib for _, mib in held))
        hot = util or 0
        return GpuUse(index=index, utilization_pct=util, memory_used_mib=used, memory_total_mib=total,
                      temperature_c=92 if thermal else 40 + hot // 4,
                      power_w=round(tdp * (0.2 + 0.75 * hot / 100), 1), processes=tuple(held))

    def utilization(self, pid: int) -> int | None:
        """The engine ``pid``'s share of its GPUs' time since its last read, from its /metrics; None: unknown."""
        now = time.monotonic()
        with self._lock:
            last = self._loads.get(pid)
        if last is not None and now - last.at < REUSE_S:
            return last.util
        url = metrics_url(pid)
        text = None
        if url is not None:
            try:
                key = engine_key(pid)  # llama-server's /metrics asks for it
                ask = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
                with urllib.request.urlopen(ask, timeout=SCRAPE_TIMEOUT_S) as resp:  # noqa: S310 - http on this host
                    text = resp.read(1 << 20).decode(errors="replace")
            except (OSError, ValueError):
                text = None
        busy = _number(_BUSY, text) if text is not None else None
        running = _number(_RUNNING, text) if text is not None else None
        if busy is not None and last is not None and last.busy is not None and busy >= last.busy:
            util: int | None = min(100, round(100 * (busy - last.busy) / max(now - last.at, 1e-3)))
        elif running is not None:
            util = 100 if running > 0 else 0
        else:
            util = None
        with self._lock:
            self._loads[pid] = _Load(now, busy, util)
            if len(self._loads) > 4096:  # engines long gone: forget the oldest reads
                for old in sorted(self._loads, key=lambda p: self._loads[p].at)[:len(self._loads) - 4096]:
                    del self._loads[old]
        return util

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
