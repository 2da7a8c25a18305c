"""The NVML port: what the agent needs of a GPU driver, and the real adapter over ``pynvml``.

This is the only module that imports ``pynvml``. Driver errors are translated
here, once: a lost GPU becomes a finding, an unsupported query is skipped, and
anything else is an ``NvmlError`` that says what to do next.
"""

from __future__ import annotations

import ctypes
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, Protocol

from llmgw.errors import NvmlError

log = logging.getLogger(__name__)

# XIDs caused by the application running on the GPU, not by the GPU: reported, never unhealthy.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68})

XID_TEXT = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup",
    48: "double-bit ECC error",
    63: "ECC page retirement or row remap recorded",
    64: "ECC page retirement or row remap failed",
    68: "video processor exception",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}

RECOVERY_TEXT = {
    1: "reset the GPU",
    2: "reboot the node",
    3: "drain peer-to-peer traffic",
    4: "drain and reset the GPU",
    5: "recover the IMEX domain",
    6: "reset the PCIe bus",
    7: "reboot the system",
}

# Marketing memory sizes in GB; NVML reports MiB a little under (81559 MiB is an "80GB" H100).
_STANDARD_GB = (8, 12, 16, 20, 24, 32, 40, 48, 64, 80, 94, 96, 128, 141, 144, 180, 192, 288)


@dataclass(frozen=True)
class Finding:
    """One reason a GPU may be unfit; ``fatal`` ones make it unhealthy."""

    code: str  # xid-79, ecc-uncorrectable, gpu-lost, thermal, …
    text: str
    fatal: bool = True


@dataclass(frozen=True)
class GpuStatic:
    """What does not change while a GPU is in the node: the inventory part."""

    index: int
    uuid: str
    name: str
    memory_mib: int
    pci_bus_id: str = ""
    mig_enabled: bool = False
    nvlink_active_links: int = 0
    fabric_cluster_uuid: str = ""
    fabric_clique_id: int = 0


@dataclass(frozen=True)
class GpuEvent:
    """An event from the driver's event set (or the simulator), handed to the agent loop."""

    index: int
    kind: Literal["xid", "ecc", "cleared"]
    xid: int = 0


@dataclass(frozen=True)
class GpuUse:
    """What a GPU is doing now: one sample; None where the driver cannot say."""

    index: int
    utilization_pct: int | None = None
    memory_used_mib: int | None = None
    memory_total_mib: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    processes: tuple[tuple[int, int | None], ...] = ()  # (pid, MiB it holds, None: unknown)


class NvmlPort(Protocol):
    """What the agent needs from NVML; the real adapter and the simulator implement it."""

    def open(self) -> None: ...

    def close(self) -> None: ...

    def driver_version(self) -> str: ...

    def gpus(self, previous: Sequence[GpuStatic] = ()) -> list[GpuStatic]: ...

    def health(self, index: int) -> list[Finding]: ...

    def wait_event(self, timeout_ms: int) -> GpuEvent | None: ...

    def sample(self, index: int) -> GpuUse | None: ...


def xid_finding(xid: int) -> Finding:
    """A critical XID as a finding; the application's own XIDs are not fatal."""
    text = XID_TEXT.get(xid, "critical error")
    if xid in APPLICATION_XIDS:
        return Finding(f"xid-{xid}", f"xid {xid}: {text} (application fault; GPU stays usable)", fatal=False)
    return Finding(f"xid-{xid}", f"xid {xid}: {text}")


GPU_LOST = Finding("gpu-lost", "GPU is lost (fell off the bus; NVML_ERROR_GPU_IS_LOST)")
THERMAL = Finding("thermal", "thermal slowdown")
POWER_BRAKE = Finding("power-brake", "power-brake slowdown")


MIB = 1024 * 1024


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def ecc_finding(count: int) -> Finding:
    return Finding("ecc-uncorrectable", f"uncorrectable ECC errors: {count} since the driver loaded")


def assess(findings: Sequence[Finding]) -> tuple[bool, tuple[str, ...]]:
    """Healthy unless a finding is fatal; reasons sorted so equal states compare equal."""
    return (not any(f.fatal for f in findings), tuple(sorted({f.text for f in findings})))


def gpu_class(name: str, memory_mib: int) -> str:
    """``H100-80GB`` from ``NVIDIA H100 80GB HBM3`` and 81559 MiB."""
    bare = re.sub(r"^(NVIDIA|Tesla|GeForce|Quadro)\s+", "", name.strip(), flags=re.I)
    bare = re.sub(r"^(NVIDIA|Tesla|GeForce|Quadro)\s+", "", bare, flags=re.I)
    model = re.split(r"[\s-]+", bare)[0] or "GPU"
    # What every reader's decoder admits (messages.GPU_CLASS_PATTERN), whatever the driver calls it.
    model = re.sub(r"[^A-Za-z0-9._]", "", model).lstrip("._")[:121] or "GPU"
    named = re.search(r"(\d+)\s*GB\b", bare, flags=re.I)
    if named:
        gb = int(named.group(1))
    else:
        gib = memory_mib / 1024
        nearest = min(_STANDARD_GB, key=lambda s: abs(s - gib))
        gb = nearest if abs(nearest - gib) <= 0.1 * nearest else round(gib)
    return f"{model}-{min(gb, 999_999)}GB"


class RealNvml:
    """The NVML adapter over ``pynvml``; ``lib`` is the module (a fake one in tests)."""

    XID_EVENTS = "nvmlEventTypeXidCriticalError"

    def __init__(self, lib: ModuleType | Any | None = None) -> None:
        if lib is None:
            import pynvml

            lib = pynvml
        self.lib = lib
        self._handles: dict[int, Any] = {}
        self._uuid_index: dict[str, int] = {}
        self._event_set: Any = None

    # --- errors, translated once --------------------------------------------------

    def _is(self, e: BaseException, *names: str) -> bool:
        return any(isinstance(e, getattr(self.lib, n, ())) for n in names)

    def _fail(self, what: str, e: BaseException) -> NvmlError:
        return NvmlError(f"NVML failed to {what} ({e}); check `nvidia-smi` on this node")

    # --- lifecycle ----------------------------------------------------------------

    def open(self) -> None:
        try:
            self.lib.nvmlInit()
        except self.lib.NVMLError as e:
            if self._is(e, "NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded", "NVMLError_NoPermission"):
                raise NvmlError(
                    f"NVML is not available ({e}); on a machine without GPUs use --simulate examples/fleet.toml"
                ) from e
            raise self._fail("initialise", e) from e
        try:
            count = self.lib.nvmlDeviceGetCount()
        except self.lib.NVMLError as e:
            raise self._fail("count the GPUs", e) from e
        self._handles = {}
        for i in range(count):
            try:
                self._handles[i] = self.lib.nvmlDeviceGetHandleByIndex(i)
            except self.lib.NVMLError as e:
                if not self._is(e, "NVMLError_GpuIsLost"):
                    raise self._fail(f"open GPU {i}", e) from e
                self._handles[i] = None  # lost at start: reported as such, not hidden
        self._open_events()

    def _open_events(self) -> None:
        lib = self.lib
        try:
            self._event_set = lib.nvmlEventSetCreate()
        except lib.NVMLError as e:
            log.warning("NVML event sets unavailable (%s); XIDs will not be watched", e)
            self._event_set = None
            return
        wanted = lib.nvmlEventTypeXidCriticalError | lib.nvmlEventTypeDoubleBitEccError
        for i, h in self._handles.items():
            if h is None:
                continue
            try:
                supported = lib.nvmlDeviceGetSupportedEventTypes(h)
                if wanted & supported:
                    lib.nvmlDeviceRegisterEvents(h, wanted & supported, self._event_set)
            except lib.NVMLError as e:
                log.warning("GPU %d: cannot watch XID events (%s)", i, e)

    def close(self) -> None:
        lib = self.lib
        if self._event_set is not None:
            try:
                lib.nvmlEventSetFree(self._event_set)
            except lib.NVMLError as e:
                log.warning("NVML: freeing the event set failed: %s", e)
            self._event_set = None
        try:
            lib.nvmlShutdown()
        except lib.NVMLError as e:
            log.warning("NVML shutdown failed: %s", e)

    def driver_version(self) -> str:
        try:
            return str(self.lib.nvmlSystemGetDriverVersion())
        except self.lib.NVMLError as e:
            raise self._fail("read the driver version", e) from e

    # --- inventory ------------------------------------------------------------------

    def gpus(self, previous: Sequence[GpuStatic] = ()) -> list[GpuStatic]:
        """Every GPU; a lost one keeps what was known of it (or a placeholder)."""
        known = {g.index: g for g in previous}
        out: list[GpuStatic] = []
        for i, h in sorted(self._handles.items()):
            try:
                if h is None:
                    raise self.lib.NVMLError_GpuIsLost()
                g = self._static(i, h)
            except self.lib.NVMLError as e:
                if not self._is(e, "NVMLError_GpuIsLost"):
                    raise self._fail(f"read GPU {i}", e) from e
                g = known.get(i) or GpuStatic(index=i, uuid=f"lost-gpu-{i}", name="unknown (GPU is lost)", memory_mib=0)
            self._uuid_index[g.uuid] = i
            out.append(g)
        return out

    def _static(self, i: int, h: Any) -> GpuStatic:
        lib = self.lib
        name = str(lib.nvmlDeviceGetName(h))
        uuid = str(lib.nvmlDeviceGetUUID(h))
        memory_mib = int(lib.nvmlDeviceGetMemoryInfo(h).total) // (1024 * 1024)
        pci = lib.nvmlDeviceGetPciInfo(h).busId
        pci_bus_id = pci.decode() if isinstance(pci, bytes) else str(pci)
        mig = False
        try:
            mig = lib.nvmlDeviceGetMigMode(h)[0] == lib.NVML_DEVICE_MIG_ENABLE
        except lib.NVMLError as e:
            if not self._unsupported(e):
                raise
        links = 0
        for link in range(lib.NVML_NVLINK_MAX_LINKS):
            try:
                links += bool(lib.nvmlDeviceGetNvLinkState(h, link))
            except lib.NVMLError as e:
                if not (self._unsupported(e) or self._is(e, "NVMLError_InvalidArgument")):
                    raise
                break  # no such link: the ones before it are all this GPU has
        cluster, clique = self._fabric(h)
        return GpuStatic(
            index=i, uuid=uuid, name=name, memory_mib=memory_mib, pci_bus_id=pci_bus_id,
            mig_enabled=mig, nvlink_active_links=links, fabric_cluster_uuid=cluster, fabric_clique_id=clique,
        )

    def _unsupported(self, e: BaseException) -> bool:
        return self._is(e, "NVMLError_NotSupported", "NVMLError_FunctionNotFound", "NVMLError_NoPermission")

    def _fabric(self, h: Any) -> tuple[str, int]:
        """NVLink fabric cluster UUID and clique, where an NVSwitch fabric manager registered the GPU."""
        lib = self.lib
        info = lib.c_nvmlGpuFabricInfo_v2_t()
        try:
            lib.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
        except lib.NVMLError as e:
            if self._unsupported(e):
                return "", 0
            raise
        if info.state != lib.NVML_GPU_FABRIC_STATE_COMPLETED or info.status != lib.NVML_SUCCESS:
            return "", 0
        raw = bytes(info.clusterUuid)
        if not any(raw):
            return "", 0
        h32 = raw.hex()
        return f"{h32[:8]}-{h32[8:12]}-{h32[12:16]}-{h32[16:20]}-{h32[20:]}", int(info.cliqueId)

    # --- health ---------------------------------------------------------------------

    def health(self, index: int) -> list[Finding]:
        """What NVML says is wrong with a GPU now; unsupported queries are skipped."""
        lib = self.lib
        h = self._handles.get(index)
        if h is None:
            return [GPU_LOST]
        findings: list[Finding] = []
        checks = (self._ecc, self._retired, self._remapped, self._clocks, self._recovery)
        for check in checks:
            try:
                findings.extend(check(h))
            except lib.NVMLError as e:
                if self._is(e, "NVMLError_GpuIsLost"):
                    return [GPU_LOST]
                if not self._unsupported(e):
                    raise self._fail(f"read the health of GPU {index}", e) from e
        return findings

    def _ecc(self, h: Any) -> list[Finding]:
        lib = self.lib
        n = lib.nvmlDeviceGetTotalEccErrors(h, lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, lib.NVML_VOLATILE_ECC)
        return [ecc_finding(int(n))] if n else []

    def _retired(self, h: Any) -> list[Finding]:
        if self.lib.nvmlDeviceGetRetiredPagesPendingStatus(h):
            return [Finding("retired-pages-pending", "retired pages pending (reset the GPU to retire them)")]
        return []

    def _remapped(self, h: Any) -> list[Finding]:
        _corr, _unc, pending, failure = self.lib.nvmlDeviceGetRemappedRows(h)
        out = []
        if pending:
            out.append(Finding("row-remap-pending", "row remap pending (reset the GPU to apply it)"))
        if failure:
            out.append(Finding("row-remap-failed", "row remap failed (the GPU needs service)"))
        return out

    def _clocks(self, h: Any) -> list[Finding]:
        lib = self.lib
        reasons = lib.nvmlDeviceGetCurrentClocksEventReasons(h)
        out = []
        if reasons & (lib.nvmlClocksEventReasonHwThermalSlowdown | lib.nvmlClocksEventReasonSwThermalSlowdown):
            out.append(THERMAL)
        if reasons & lib.nvmlClocksEventReasonHwPowerBrakeSlowdown:
            out.append(POWER_BRAKE)
        return out

    def _recovery(self, h: Any) -> list[Finding]:
        lib = self.lib
        value = lib.nvmlDeviceGetFieldValues(h, [lib.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])[0]
        if value.nvmlReturn != lib.NVML_SUCCESS:
            return []  # this driver does not know the field
        action = int(value.value.uiVal)
        if action == lib.NVML_GPU_RECOVERY_ACTION_NONE:
            return []
        return [Finding("recovery-action", f"NVML recommends: {RECOVERY_TEXT.get(action, f'recovery action {action}')}")]

    # --- use ----------------------------------------------------------------------------

    def sample(self, index: int) -> GpuUse | None:
        """Utilization, memory, temperature, power and compute processes; None for a lost GPU.

        Never raises: a sample is for people to look at, and a reading that fails leaves its
        field unknown (the health checks are what speak about a failing GPU).
        """
        lib = self.lib
        h = self._handles.get(index)
        if h is None:
            return None
        values: dict[str, Any] = {}
        reads: tuple[tuple[str, Any], ...] = (
            ("util", lambda: lib.nvmlDeviceGetUtilizationRates(h).gpu),
            ("memory", lambda: lib.nvmlDeviceGetMemoryInfo(h)),
            ("temperature", lambda: lib.nvmlDeviceGetTemperature(h, lib.NVML_TEMPERATURE_GPU)),
            ("power", lambda: lib.nvmlDeviceGetPowerUsage(h)),
            ("processes", lambda: lib.nvmlDeviceGetComputeRunningProcesses(h)),
        )
        for name, read in reads:
            try:
                values[name] = read()
            except lib.NVMLError as e:
                if self._is(e, "NVMLError_GpuIsLost"):
                    return None
                if not self._unsupported(e):
                    log.debug("GPU %d: cannot read its %s: %s", index, name, e)
        mem = values.get("memory")
        processes = []
        for p in values.get("processes") or ():
            used = getattr(p, "usedGpuMemory", None)  # pynvml: None when NVML_VALUE_NOT_AVAILABLE
            processes.append((int(p.pid), None if used is None else int(used) // MIB))
        return GpuUse(
            index=index,
            utilization_pct=_int_or_none(values.get("util")),
            memory_used_mib=None if mem is None else int(mem.used) // MIB,
            memory_total_mib=None if mem is None else int(mem.total) // MIB,
            temperature_c=_int_or_none(values.get("temperature")),
            power_w=None if values.get("power") is None else int(values["power"]) / 1000,  # NVML: milliwatts
            processes=tuple(processes),
        )

    # --- events ------------------------------------------------------------------------

    def wait_event(self, timeout_ms: int) -> GpuEvent | None:
        """Block up to ``timeout_ms`` for an XID or ECC event (run in a thread)."""
        lib = self.lib
        if self._event_set is None:
            return None
        try:
            data = lib.nvmlEventSetWait_v2(self._event_set, timeout_ms)
        except lib.NVMLError as e:
            if self._is(e, "NVMLError_Timeout"):
                return None
            if self._is(e, "NVMLError_GpuIsLost"):
                return GpuEvent(index=-1, kind="ecc")  # some GPU is gone: make the agent look
            raise self._fail("wait for GPU events", e) from e
        try:
            index = self._uuid_index.get(str(lib.nvmlDeviceGetUUID(data.device)), -1)
        except lib.NVMLError:
            index = -1
        if data.eventType & lib.nvmlEventTypeXidCriticalError:
            return GpuEvent(index=index, kind="xid", xid=int(data.eventData))
        return GpuEvent(index=index, kind="ecc")
