"""The fleet stream (``llmgw.fleet.<node>.*``), the heartbeat stream, and the agents' fault commands."""

from __future__ import annotations

from typing import Annotated

import msgspec

from llmgw.messages.base import (
    MAX_GPUS,
    Event,
    Fabric,
    GpuClass,
    GpuIndex,
    Label,
    Name,
    Reasons,
    Ref,
    Seconds,
    Seq,
    Text,
    Time,
)

# --- fleet stream: llmgw.fleet.<node>.* -------------------------------------


class GpuInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU as NVML (or the simulator) reports it."""

    index: GpuIndex
    uuid: Label
    name: Label
    gpu_class: GpuClass
    memory_mib: Annotated[int, msgspec.Meta(ge=0, le=1 << 30)]  # up to 1 PiB
    pci_bus_id: Label = ""
    mig_enabled: bool = False
    nvlink_active_links: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    fabric_cluster_uuid: Label = ""
    healthy: bool = True
    reasons: Reasons = ()


class NodeInventoryReported(Event, tag="NodeInventoryReported", frozen=True, kw_only=True):
    """A full account of a node's GPUs, health included; replaces what was known."""

    node: Name
    fabric: Fabric
    fabric_source: Label  # flag | nvml-fabric | infiniband | fleet-file | default
    boot_id: Label
    gpus: Annotated[tuple[GpuInfo, ...], msgspec.Meta(max_length=MAX_GPUS)]
    driver_version: Label = ""
    simulated: bool = False
    # What the engines this agent starts say they are (``vllm --version``, ``llama-server --version``);
    # "" when not installed or not asked. The planner plans for the version the fleet runs.
    vllm_version: Label = ""
    llamacpp_version: Label = ""


class GpuHealthChanged(Event, tag="GpuHealthChanged", frozen=True, kw_only=True):
    """A GPU went from healthy to unhealthy or back; only transitions are events."""

    node: Ref
    gpu_index: GpuIndex
    gpu_uuid: Label
    healthy: bool
    reasons: Reasons = ()
    boot_id: Label = ""


class NodeLost(Event, tag="NodeLost", frozen=True, kw_only=True):
    """A node missed its heartbeats for longer than the timeout."""

    node: Ref
    last_heartbeat_at: Time | None = None
    timeout_s: Seconds = 60.0


class NodeReturned(Event, tag="NodeReturned", frozen=True, kw_only=True):
    """A lost node is heard from again."""

    node: Ref
    boot_id: Label = ""


class NodeRetired(Event, tag="NodeRetired", frozen=True, kw_only=True):
    """An operator removed a node that is gone for good (admin only); if it reports again, it is back."""

    node: Ref
    reason: Text = ""


# --- what a node holds on disk: llmgw.fleet.<node>.files|download|evicted ------------

MAX_HELD_SOURCES = 256  # model sources in one report: a node's disk, not a registry
MAX_HELD_FILES = 128  # files of one source in a report: a 405B checkpoint has under 200 shards; the agent keeps the largest
Bytes = Annotated[int, msgspec.Meta(ge=0, le=1 << 50)]  # a PiB: more than any node's disk
Digest = Annotated[str, msgspec.Meta(max_length=80, pattern=r"^((sha256|git-sha1):[0-9a-f]{40,64})?\Z")]


class HeldFile(msgspec.Struct, frozen=True, kw_only=True):
    """One file of a model source on a node's disk."""

    path: Text  # relative to the source's snapshot or directory
    size: Bytes
    digest: Digest = ""  # "sha256:…" (the cache's LFS blob hash, or the agent's for a GGUF), "git-sha1:…"; "": not yet
    complete: bool = True  # False: a partial download (resumed, never served)


class HeldSource(msgspec.Struct, frozen=True, kw_only=True):
    """A model source (a repository id, as a spec names it) and what of it one of a node's stores holds."""

    source: Text
    store: Label  # hf-cache | models-dir
    revision: Label = ""  # the cache's commit hash; "" in the models directory (no revision recorded)
    files: Annotated[tuple[HeldFile, ...], msgspec.Meta(max_length=MAX_HELD_FILES)] = ()
    complete: bool = True  # every file its own index names is there, none partial
    size: Bytes = 0  # all its files together (the report may list only the largest)
    last_used: Time | None = None


class NodeFilesReported(Event, tag="NodeFilesReported", frozen=True, kw_only=True):
    """A full account of the model files on a node's disk; replaces what was known of its files."""

    node: Name
    boot_id: Label = ""
    sources: Annotated[tuple[HeldSource, ...], msgspec.Meta(max_length=MAX_HELD_SOURCES)] = ()
    disk_budget: Bytes = 0  # what the agent may fill (``--cache-max-gib``)
    disk_free: Bytes = 0  # what the disk under its stores has free
    truncated: bool = False  # more sources than a report carries: the least recently used were left out


class DownloadProgressed(Event, tag="DownloadProgressed", frozen=True, kw_only=True):
    """A node's agent is fetching a model's files: how far, and how fast (at most every few seconds)."""

    node: Name
    model: Ref
    source: Text
    done: Bytes
    total: Bytes
    rate: Annotated[float, msgspec.Meta(ge=0, le=1 << 50)] = 0.0  # bytes per second since the last report
    started_at: Time | None = None


class DownloadFinished(Event, tag="DownloadFinished", frozen=True, kw_only=True):
    """A download ended: verified (``ok``), or refused with the reason (a digest mismatch, a full disk)."""

    node: Name
    model: Ref
    source: Text
    ok: bool
    size: Bytes = 0
    seconds: Seconds = 0.0
    files: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    mismatches: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0  # files whose digest disagreed, fetched again
    reason: Text = ""
    code: Label = ""  # verified | mismatch | disk-full | not-found | error
    started_at: Time | None = None


class FilesEvicted(Event, tag="FilesEvicted", frozen=True, kw_only=True):
    """An agent deleted a source's files to stay within its disk budget (least recently used first)."""

    node: Name
    source: Text
    store: Label
    size: Bytes
    last_used: Time | None = None
    reason: Text = ""


FleetEvent = (NodeInventoryReported | GpuHealthChanged | NodeLost | NodeReturned | NodeRetired | NodeFilesReported
              | DownloadProgressed | DownloadFinished | FilesEvicted)


# --- heartbeat stream: llmgw.heartbeat.<node> (latest only, never replayed) --


MIB_MAX = 1 << 24  # 16 TiB in MiB: more than any GPU holds, so a larger figure is a broken reading


class GpuProcess(msgspec.Struct, frozen=True, kw_only=True):
    """A process holding memory on a GPU, as NVML lists it."""

    pid: Annotated[int, msgspec.Meta(ge=1, le=1 << 22)]  # Linux's pid_max is at most 2^22
    used_mib: Annotated[int, msgspec.Meta(ge=0, le=MIB_MAX)] | None = None  # None: NVML cannot say (MIG, permissions)


class GpuSample(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU's use at one heartbeat; None where NVML cannot say (unknown is not idle)."""

    index: Annotated[int, msgspec.Meta(ge=0, le=255)]
    utilization_pct: Annotated[int, msgspec.Meta(ge=0, le=100)] | None = None
    memory_used_mib: Annotated[int, msgspec.Meta(ge=0, le=MIB_MAX)] | None = None
    memory_total_mib: Annotated[int, msgspec.Meta(ge=0, le=MIB_MAX)] | None = None
    temperature_c: Annotated[int, msgspec.Meta(ge=-60, le=200)] | None = None
    power_w: Annotated[float, msgspec.Meta(ge=0, le=10_000)] | None = None
    processes: Annotated[tuple[GpuProcess, ...], msgspec.Meta(max_length=64)] = ()


class HeartbeatSent(Event, tag="HeartbeatSent", frozen=True, kw_only=True):
    """An agent is alive; kept out of the history that status replays."""

    node: Name
    boot_id: Label
    seq: Seq
    # Each GPU's use when the agent last sampled it (latest per node: the heartbeat stream keeps one).
    # Bounded here: an agent clamps what it reads, so a heartbeat out of range is a broken agent.
    gpus: Annotated[tuple[GpuSample, ...], msgspec.Meta(max_length=256)] = ()


HeartbeatEvent = HeartbeatSent


# --- agent commands: llmgw.agent.<node>.fault (request/reply, not stored) ------


class InjectFault(msgspec.Struct, frozen=True, kw_only=True, tag="InjectFault", tag_field="type"):
    """Make a simulated GPU go bad, or clear it: a command for demos and tests."""

    node: Name
    gpu: GpuIndex
    kind: Label  # xid | ecc | lost | thermal | clear
    xid: Annotated[int, msgspec.Meta(ge=0, le=65_535)] = 0


class FaultInjected(msgspec.Struct, frozen=True, kw_only=True, tag="FaultInjected", tag_field="type"):
    """A simulated GPU's health right after a fault was injected."""

    node: str
    gpu: int
    kind: str
    healthy: bool
    reasons: tuple[str, ...] = ()
    changed: bool = False  # the state changed, so a GpuHealthChanged was queued
