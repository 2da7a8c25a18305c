"""The NVML adapter against a fake ``pynvml`` module: the fake stands in for the driver.

The fake copies pynvml's constants, error classes and ctypes structures (data,
not driver) and replaces every function the adapter calls with one backed by
``FakeGpu`` records, so each driver answer and each driver error is exercised.
"""

from __future__ import annotations

import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml as real
import pytest
from click.testing import CliRunner

from llmgw.agent.nvml import GPU_LOST, GpuUse, RealNvml, assess, gpu_class, xid_finding
from llmgw.agent.simnvml import SimNvml
from llmgw.cli.main import cli
from llmgw.errors import NvmlError
from llmgw.fleetfile import load
from llmgw.messages import GPU_CLASS_PATTERN

CLUSTER = bytes(range(1, 17))


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    total_bytes: int = 81559 * 1024 * 1024
    bus_id: bytes = b"00000000:18:00.0"
    mig: int = 0
    nvlinks: int = 18
    fabric_state: int = real.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED
    ecc_uncorrected: int = 0
    retired_pending: int = 0
    remap: tuple[int, int, int, int] = (0, 0, 0, 0)
    clocks: int = 0
    recovery: int = real.NVML_GPU_RECOVERY_ACTION_NONE
    recovery_ret: int = real.NVML_SUCCESS
    events: int = real.nvmlEventTypeXidCriticalError | real.nvmlEventTypeDoubleBitEccError
    util: int = 0
    used_bytes: int = 0
    temperature: int = 30
    power_mw: int = 70_000
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes; None: not available)
    raises: dict[str, type[BaseException]] = field(default_factory=dict)  # function name → error


class FakeDriver:
    """The state behind the fake module's functions, and a record of what was called."""

    def __init__(self, gpus: list[FakeGpu], *, init_error: type[BaseException] | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.calls: set[str] = set()
        self.pending: list[Any] = []  # what nvmlEventSetWait_v2 returns next
        self.registered: dict[int, int] = {}

    def module(self) -> types.ModuleType:
        mod = types.ModuleType("pynvml")
        for name in dir(real):
            if name.startswith(("NVML", "nvmlEventType", "nvmlClocksEventReason", "c_nvml")):
                setattr(mod, name, getattr(real, name))
        for name in dir(self):
            if name.startswith("nvml"):
                setattr(mod, name, self._recording(name))
        return mod

    def _recording(self, name: str) -> Any:
        fn = getattr(self, name)

        def call(*args: Any) -> Any:
            self.calls.add(name)
            if args and isinstance(args[0], int) and 0 <= args[0] < len(self.gpus) and name.startswith("nvmlDevice") and name != "nvmlDeviceGetHandleByIndex":
                err = self.gpus[args[0]].raises.get(name)
                if err is not None:
                    raise err()
            if name == "nvmlDeviceGetHandleByIndex":
                err = self.gpus[args[0]].raises.get(name)
                if err is not None:
                    raise err()
            return fn(*args)

        return call

    # handles are GPU indices
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error()

    def nvmlShutdown(self) -> None: ...

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return self.gpus[h].name

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self.gpus[h].uuid

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        g = self.gpus[h]
        return types.SimpleNamespace(total=g.total_bytes, used=g.used_bytes, free=g.total_bytes - g.used_bytes)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return types.SimpleNamespace(gpu=self.gpus[h].util, memory=0)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        assert sensor == real.NVML_TEMPERATURE_GPU
        return self.gpus[h].temperature

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self.gpus[h].power_mw

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.gpus[h].processes]

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return types.SimpleNamespace(busId=self.gpus[h].bus_id)

    def nvmlDeviceGetMigMode(self, h: int) -> list[int]:
        return [self.gpus[h].mig, self.gpus[h].mig]

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        if link >= self.gpus[h].nvlinks:
            raise real.NVMLError_InvalidArgument()
        return 1 if link % 2 == 0 else 0  # every other link up: the count must be read, not assumed

    def nvmlDeviceGetGpuFabricInfoV(self, h: int, ref: Any) -> int:
        info = ref._obj
        info.state = self.gpus[h].fabric_state
        info.status = real.NVML_SUCCESS
        if info.state == real.NVML_GPU_FABRIC_STATE_COMPLETED:
            for i, b in enumerate(CLUSTER):
                info.clusterUuid[i] = b
            info.cliqueId = 7
        return real.NVML_SUCCESS

    def nvmlDeviceGetTotalEccErrors(self, h: int, error_type: int, counter: int) -> int:
        assert (error_type, counter) == (real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, real.NVML_VOLATILE_ECC)
        return self.gpus[h].ecc_uncorrected

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: int) -> int:
        return self.gpus[h].retired_pending

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        return self.gpus[h].remap

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return self.gpus[h].clocks

    def nvmlDeviceGetFieldValues(self, h: int, ids: list[int]) -> list[Any]:
        assert ids == [real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
        v = real.c_nvmlFieldValue_t()
        v.fieldId, v.nvmlReturn = ids[0], self.gpus[h].recovery_ret
        v.value.uiVal = self.gpus[h].recovery
        return [v]

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceGetSupportedEventTypes(self, h: int) -> int:
        return self.gpus[h].events

    def nvmlDeviceRegisterEvents(self, h: int, types_: int, event_set: str) -> None:
        self.registered[h] = types_

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        if not self.pending:
            raise real.NVMLError_Timeout()
        item = self.pending.pop(0)
        if isinstance(item, type):
            raise item()
        return item

    def nvmlEventSetFree(self, event_set: str) -> None: ...


def _adapter(*gpus: FakeGpu, init_error: type[BaseException] | None = None) -> tuple[RealNvml, FakeDriver]:
    driver = FakeDriver(list(gpus), init_error=init_error)
    return RealNvml(driver.module()), driver


def _gpu(i: int, **kw: Any) -> FakeGpu:
    return FakeGpu(uuid=f"GPU-{i:08d}-aaaa-bbbb-cccc-dddddddddddd", bus_id=f"00000000:{0x18 + i:02X}:00.0".encode(), **kw)


# --- pure parts -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "mib", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        ("NVIDIA A100-SXM4-40GB", 40960, "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"),
        ("NVIDIA L40S", 46068, "L40S-48GB"),
        ("NVIDIA H200", 143771, "H200-141GB"),
        ("NVIDIA H100 NVL", 95830, "H100-94GB"),
        ("Tesla V100-SXM2-16GB", 16160, "V100-16GB"),
        ("NVIDIA GeForce RTX 4090", 24564, "RTX-24GB"),
    ],
)
def test_gpu_class_from_name_and_memory(name: str, mib: int, expected: str) -> None:
    assert gpu_class(name, mib) == expected


@pytest.mark.parametrize(("name", "mib"), [
    ("NVIDIA _X 80GB", 81920), ("NVIDIA " + "Z" * 200, 81920), ("NVIDIA Foo 1234567GB", 81920), ("", 0),
    ("<script>", 1024),
])
def test_any_driver_name_makes_a_class_every_reader_accepts(name: str, mib: int) -> None:
    # The readers refuse an inventory whose class is not of this shape: the node would silently not show.
    assert re.match(GPU_CLASS_PATTERN, gpu_class(name, mib)), gpu_class(name, mib)


def test_simulated_gpu_class_round_trips_the_fleet_file(fleet_file: Any) -> None:
    fleet = load(fleet_file)
    for node in fleet.nodes:
        for g in SimNvml(node).gpus():
            assert gpu_class(g.name, g.memory_mib) == node.gpu_class, (node.name, g.name)


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 68])
def test_application_xids_are_reported_but_not_fatal(xid: int) -> None:
    f = xid_finding(xid)
    assert not f.fatal and f.text.startswith(f"xid {xid}:")
    assert assess([f]) == (True, (f.text,))


@pytest.mark.parametrize("xid", [48, 63, 64, 74, 79, 92, 94, 95])
def test_hardware_xids_make_a_gpu_unhealthy(xid: int) -> None:
    healthy, reasons = assess([xid_finding(xid), xid_finding(13)])
    assert not healthy and any(r.startswith(f"xid {xid}:") for r in reasons)


# --- the adapter over the fake driver -----------------------------------------------------


def test_inventory_reads_every_static_field() -> None:
    nvml, driver = _adapter(_gpu(0, mig=1, fabric_state=real.NVML_GPU_FABRIC_STATE_COMPLETED), _gpu(1, nvlinks=4))
    nvml.open()
    g0, g1 = nvml.gpus()
    assert g0.name == "NVIDIA H100 80GB HBM3" and g0.memory_mib == 81559
    assert g0.uuid == "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd" and g0.pci_bus_id == "00000000:18:00.0"
    assert g0.mig_enabled and not g1.mig_enabled
    assert (g0.nvlink_active_links, g1.nvlink_active_links) == (9, 2)
    assert g0.fabric_cluster_uuid == "01020304-0506-0708-090a-0b0c0d0e0f10" and g0.fabric_clique_id == 7
    assert g1.fabric_cluster_uuid == "" and g1.fabric_clique_id == 0
    assert nvml.driver_version() == "550.54.15"
    assert driver.registered == {0: driver.gpus[0].events, 1: driver.gpus[1].events}
    nvml.close()


def test_unsupported_queries_are_skipped_not_fatal() -> None:
    unsupported = {n: real.NVMLError_NotSupported for n in (
        "nvmlDeviceGetMigMode", "nvmlDeviceGetNvLinkState", "nvmlDeviceGetGpuFabricInfoV",
        "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetFieldValues")}
    nvml, _ = _adapter(_gpu(0, raises=unsupported, recovery_ret=real.NVML_ERROR_NOT_SUPPORTED))
    nvml.open()
    (g,) = nvml.gpus()
    assert (g.mig_enabled, g.nvlink_active_links, g.fabric_cluster_uuid) == (False, 0, "")
    assert nvml.health(0) == []


@pytest.mark.parametrize(
    ("kw", "code"),
    [
        ({"ecc_uncorrected": 2}, "ecc-uncorrectable"),
        ({"retired_pending": 1}, "retired-pages-pending"),
        ({"remap": (3, 1, 1, 0)}, "row-remap-pending"),
        ({"remap": (0, 0, 0, 1)}, "row-remap-failed"),
        ({"clocks": real.nvmlClocksEventReasonHwThermalSlowdown}, "thermal"),
        ({"clocks": real.nvmlClocksEventReasonSwThermalSlowdown}, "thermal"),
        ({"clocks": real.nvmlClocksEventReasonHwPowerBrakeSlowdown}, "power-brake"),
        ({"recovery": real.NVML_GPU_RECOVERY_ACTION_GPU_RESET}, "recovery-action"),
    ],
)
def test_each_health_condition_is_a_fatal_finding(kw: dict[str, Any], code: str) -> None:
    nvml, _ = _adapter(_gpu(0, **kw))
    nvml.open()
    findings = nvml.health(0)
    assert [f.code for f in findings] == [code] and findings[0].fatal
    assert not assess(findings)[0]


def test_a_healthy_gpu_has_no_findings_and_idle_clocks_are_fine() -> None:
    nvml, _ = _adapter(_gpu(0, clocks=real.nvmlClocksEventReasonGpuIdle | real.nvmlClocksEventReasonSwPowerCap))
    nvml.open()
    assert nvml.health(0) == []


def test_recovery_action_text_names_the_next_step() -> None:
    nvml, _ = _adapter(_gpu(0, recovery=real.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT))
    nvml.open()
    assert [f.text for f in nvml.health(0)] == ["NVML recommends: reboot the node"]


def test_a_gpu_that_fell_off_the_bus_is_lost_not_an_error() -> None:
    nvml, driver = _adapter(_gpu(0), _gpu(1))
    nvml.open()
    before = nvml.gpus()
    driver.gpus[1].raises = {n: real.NVMLError_GpuIsLost for n in ("nvmlDeviceGetName", "nvmlDeviceGetTotalEccErrors")}
    assert nvml.health(1) == [GPU_LOST]
    after = nvml.gpus(before)
    assert after[1] == before[1]  # what was known of it stays in the inventory
    assert nvml.health(0) == []


def test_a_gpu_lost_before_start_gets_a_placeholder() -> None:
    nvml, _ = _adapter(_gpu(0), _gpu(1, raises={"nvmlDeviceGetHandleByIndex": real.NVMLError_GpuIsLost}))
    nvml.open()
    g0, g1 = nvml.gpus()
    assert g0.memory_mib == 81559 and g1.uuid == "lost-gpu-1" and g1.memory_mib == 0
    assert nvml.health(1) == [GPU_LOST]


@pytest.mark.parametrize("error", [real.NVMLError_LibraryNotFound, real.NVMLError_DriverNotLoaded])
def test_no_driver_says_so_and_suggests_simulate(error: type[BaseException]) -> None:
    nvml, _ = _adapter(init_error=error)
    with pytest.raises(NvmlError) as e:
        nvml.open()
    assert str(e.value) == f"NVML is not available ({error()}); on a machine without GPUs use --simulate examples/fleet.toml"


def test_other_driver_errors_are_translated_with_the_next_step() -> None:
    nvml, _ = _adapter(_gpu(0, raises={"nvmlDeviceGetTotalEccErrors": real.NVMLError_Unknown}))
    nvml.open()
    with pytest.raises(NvmlError, match=r"NVML failed to read the health of GPU 0 \(Unknown Error\); check `nvidia-smi`"):
        nvml.health(0)
    nvml_init, _ = _adapter(init_error=real.NVMLError_Unknown)
    with pytest.raises(NvmlError, match="NVML failed to initialise"):
        nvml_init.open()


def test_events_map_to_gpus_by_uuid() -> None:
    nvml, driver = _adapter(_gpu(0), _gpu(1))
    nvml.open()
    nvml.gpus()
    assert nvml.wait_event(10) is None  # NVMLError_Timeout: nothing happened
    driver.pending = [
        types.SimpleNamespace(device=1, eventType=real.nvmlEventTypeXidCriticalError, eventData=79),
        types.SimpleNamespace(device=0, eventType=real.nvmlEventTypeDoubleBitEccError, eventData=0),
        real.NVMLError_GpuIsLost,
        real.NVMLError_Unknown,
    ]
    first, second, third = (nvml.wait_event(10) for _ in range(3))
    assert (first.index, first.kind, first.xid) == (1, "xid", 79)  # type: ignore[union-attr]
    assert (second.index, second.kind) == (0, "ecc")  # type: ignore[union-attr]
    assert (third.index, third.kind) == (-1, "ecc")  # type: ignore[union-attr]
    with pytest.raises(NvmlError, match="wait for GPU events"):
        nvml.wait_event(10)


def test_every_driver_call_the_adapter_makes_is_covered() -> None:
    nvml, driver = _adapter(_gpu(0))
    nvml.open()
    nvml.gpus()
    nvml.health(0)
    nvml.driver_version()
    nvml.sample(0)
    driver.pending = [types.SimpleNamespace(device=0, eventType=real.nvmlEventTypeXidCriticalError, eventData=48)]
    nvml.wait_event(10)
    nvml.close()
    provided = {n for n in dir(driver) if n.startswith("nvml")}
    assert driver.calls == provided


def test_a_sample_reads_use_memory_temperature_power_and_processes() -> None:
    mib = 1024 * 1024
    nvml, _ = _adapter(_gpu(0, util=87, used_bytes=71_000 * mib, temperature=64, power_mw=512_345,
                            processes=[(4242, 70_000 * mib), (4343, None)]), _gpu(1))
    nvml.open()
    busy, idle = nvml.sample(0), nvml.sample(1)
    assert busy == GpuUse(index=0, utilization_pct=87, memory_used_mib=71_000, memory_total_mib=81559,
                          temperature_c=64, power_w=512.345, processes=((4242, 70_000), (4343, None)))
    assert idle == GpuUse(index=1, utilization_pct=0, memory_used_mib=0, memory_total_mib=81559,
                          temperature_c=30, power_w=70.0)


def test_a_sample_leaves_what_the_driver_cannot_say_unknown_and_skips_a_lost_gpu() -> None:
    unsupported = {n: real.NVMLError_NotSupported for n in (
        "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetComputeRunningProcesses")}
    nvml, driver = _adapter(_gpu(0, raises={**unsupported, "nvmlDeviceGetTemperature": real.NVMLError_Unknown}),
                            _gpu(1), _gpu(2, raises={"nvmlDeviceGetHandleByIndex": real.NVMLError_GpuIsLost}))
    nvml.open()
    # Unknown is not idle: None, never 0; and an odd driver error costs the field, not the sample.
    assert nvml.sample(0) == GpuUse(index=0, memory_used_mib=0, memory_total_mib=81559)
    driver.gpus[1].raises = {"nvmlDeviceGetTemperature": real.NVMLError_GpuIsLost}
    assert nvml.sample(1) is None  # fell off the bus mid-sample: the health check says so, not a sample
    assert nvml.sample(2) is None  # lost before start


def test_cli_without_nvml_is_one_line_and_exit_1(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = FakeDriver([], init_error=real.NVMLError_LibraryNotFound)
    monkeypatch.setitem(sys.modules, "pynvml", driver.module())
    result = CliRunner().invoke(cli, ["agent", "--node", "gpu-01", "--nats-url", "nats://127.0.0.1:1"])
    assert result.exit_code == 1
    assert result.output == (
        "Error: NVML is not available (NVML Shared Library Not Found); "
        "on a machine without GPUs use --simulate examples/fleet.toml\n"
    )


@pytest.mark.parametrize("example", ["fleet.toml", "cpu.toml", "cpu-vllm.toml"])
def test_a_fleet_files_gpu_class_holds_whatever_its_gpu_name(example: str) -> None:
    """Issue 43 #8: examples/cpu.toml says CPU-16GB with a gpu_name, and the agent reported host-16GB."""
    fleet = load(Path(__file__).resolve().parent.parent / "examples" / example)
    for node in fleet.nodes:
        for g in SimNvml(node).gpus():
            assert gpu_class(g.name, g.memory_mib) == node.gpu_class, (node.name, g.name)
