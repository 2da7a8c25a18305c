"""The status service's bodies (``llmgw.status``, request/reply, not stored)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import msgspec

from llmgw.messages.control import ControlEvent, GpuRef, ModelSpec, ReplicaOverBooked
from llmgw.messages.fleet import GpuSample

# --- status service: llmgw.status (request/reply) ------------------------------


class StatusRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Ask the projector for the fleet status; idle is judged against this threshold."""

    idle_threshold_s: float = 1800.0
    # Judge idle against this time (the asker's clock, e.g. ``ctl idle``) instead of the
    # time of the last event folded, which stands still while nothing happens.
    now: Annotated[datetime, msgspec.Meta(tz=True)] | None = None
    # Answer only once the projector has folded these stream sequences (what the asker saw
    # stored when it asked), waiting up to ``wait_s``: status reads its own writes.
    wait_for: dict[str, Annotated[int, msgspec.Meta(ge=0)]] = {}
    wait_s: Annotated[float, msgspec.Meta(ge=0, le=30)] = 5.0
    # Also every replica (``StatusReport.replica_list``), and one model in full (``model_detail``).
    replicas: bool = False
    model: Annotated[str, msgspec.Meta(max_length=256)] = ""
    # Also every node's latest GPU samples (``StatusReport.node_gpus``): the dashboard's, not ``ctl status``'s.
    gpus: bool = False
    # Also the usage per key, tenant, model or adapter over the last ``usage_days`` (UTC), from the
    # projector's DuckDB file once it has committed what it folded (``StatusReport.usage``; ``ctl usage``).
    usage_by: Literal["", "key", "tenant", "model", "adapter"] = ""
    usage_days: Annotated[int, msgspec.Meta(ge=1, le=3660)] = 7


class ClassCapacity(msgspec.Struct, frozen=True, kw_only=True):
    """GPUs of one class: used + free + unhealthy + lost == total (whole GPUs: used holds a replica).

    And the memory of its usable GPUs (healthy, on live nodes), MiB: what replicas booked on them,
    what is left (per GPU, summed; and the most one GPU has: what a replica sharing a card can find),
    and what the replicas' engines report holding there (``observed_memory_mib``; None: none reports).
    """

    gpu_class: str
    total: int
    used: int
    free: int
    unhealthy: int
    lost: int = 0
    memory_mib: int = 0
    booked_mib: int = 0
    free_mib: int = 0
    most_free_mib: int = 0
    used_mib: int | None = None


class GpuBooking(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU some replica holds: who booked how much of it (``ctl status --replicas``, the dashboard)."""

    node: str
    index: int
    gpu_class: str
    memory_mib: int
    booked_mib: int
    replicas: tuple[tuple[str, int], ...] = ()  # (replica id, MiB it booked here), in placement order


class AdapterStatus(msgspec.Struct, frozen=True, kw_only=True):
    """A declared LoRA adapter and the replicas whose engines hold it now."""

    name: str
    base: str
    format: str
    rank: int
    size_bytes: int
    held_by: tuple[str, ...] = ()
    last_request: datetime | None = None  # when a router last said it was asked for (None: not in 30 days)


class FabricNodes(msgspec.Struct, frozen=True, kw_only=True):
    """Whole nodes of one class on one fabric with every GPU healthy and free."""

    fabric: str
    gpu_class: str
    free_nodes: int
    live_nodes: int


class UnplaceableModel(msgspec.Struct, frozen=True, kw_only=True):
    """A declared model the scheduler could not place, and why."""

    name: str
    reason: str
    since: datetime | None = None


class IdleReplica(msgspec.Struct, frozen=True, kw_only=True):
    """A replica nobody asked for; ``idle_s`` < 0 means no router knows."""

    replica_id: str
    model: str
    gpus: int
    nodes: tuple[str, ...]
    state: str
    idle_s: float
    idle_since: datetime | None = None
    # Prompt tokens its engine reported through the routers, and of them cached (0, 0: none reported).
    prompt_tokens: int = 0
    cached_tokens: int = 0


class FileFetch(msgspec.Struct, frozen=True, kw_only=True):
    """A download of a model's files on one node, as its agent last reported it."""

    node: str
    done: int
    total: int
    rate: float  # bytes a second
    at: datetime | None = None


class ModelSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One declared model at a glance: a row of ``ctl model list`` and of ``ctl status``.

    ``idle_s`` is since anyone asked for any of its replicas: -1 when a replica
    no router knows could have been asked (unknown is not idle) or none is placed.
    KV tokens: the plan's per replica, and what its engines last reported reserving where a
    card sized the cache (llama.cpp's always: it allocates the plan's -c) since it was
    declared, kept when its replicas stop (0: none reported).
    """

    name: str
    state: str  # serving | starting | failing | parked | unplaceable | stopped | down (the control plane is)
    healthy: int
    placed: int
    wanted: int
    set_by: str  # who set ``wanted`` last: declared | operator | autoscaler
    min_replicas: int | None
    max_replicas: int | None
    target_in_flight: float | None  # None: a fixed replica count
    idle_ttl_s: float | None
    source: str
    precision: str
    engine: str
    quantization: str | None
    gpu_class: str
    tp: int
    pp: int  # nodes per replica
    gpus_per_replica: int
    context: int
    unplaceable: str | None
    kv_tokens_planned: int
    kv_tokens_observed: int
    unplaceable_since: datetime | None = None
    declared_at: datetime | None = None
    gpus_held: int = 0
    idle_s: float = -1.0
    idle_since: datetime | None = None
    gpu_hours_today: float = 0.0  # GPUs its replicas held since midnight UTC of ``now``, stopped ones too
    # Failing: the last error line its engines' failures reported (an agent's report), and when.
    failure: str | None = None
    failure_at: datetime | None = None
    # Nodes whose disks hold its files complete (their agents' NodeFilesReported); -1: no node reports
    # its disk (agents without --keep-files), so nothing is known either way.
    files_nodes: int = -1
    fetching: tuple[FileFetch, ...] = ()  # its downloads in flight


class ReplicaRow(msgspec.Struct, frozen=True, kw_only=True):
    """One replica as the fold knows it; ``idle_s`` < 0: no router knows, ``kv_tokens_observed`` 0: not reported.

    ``kv_error`` is (planned - observed) / observed, as ``ctl model plan`` states the
    estimate's error; None when either is unknown, or the figure was not sized by its card
    (a simulated node, an explicit cache size: ``llmgw.fleet.observed.not_sized_by_card``).
    """

    replica_id: str
    model: str
    state: str  # placed | starting | healthy | unhealthy | failed | down (the control plane is)
    nodes: tuple[str, ...]
    gpus: tuple[GpuRef, ...]
    fabric: str
    endpoint: str
    restarts: int
    detail: str
    placed_at: datetime | None
    state_at: datetime | None
    idle_s: float
    idle_since: datetime | None
    kv_tokens_planned: int
    kv_tokens_observed: int
    kv_error: float | None = None
    # GPU memory the engine's processes hold, per node, as its agent read NVML (empty: not reported).
    observed_memory_mib: dict[str, int] = {}
    # MiB it booked on each node, over its GPUs there (a placement from before sharing: the whole cards).
    booked_mib: dict[str, int] = {}
    # The last time its engine held more than it booked, by more than OVERBOOK_MARGIN (None: never).
    overbooked: ReplicaOverBooked | None = None
    # Prompt tokens its engine reported through every router since it was placed, and how many it
    # served from its prefix cache (the routers' maps, ``cache_use``); 0 and 0: none reported.
    prompt_tokens: int = 0
    cached_tokens: int = 0


class ModelEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One control-stream event about a model, where the stream stored it."""

    seq: int
    event: ControlEvent


class ColdStart(msgspec.Struct, frozen=True, kw_only=True):
    """One wake or scale-up of a model: each phase at its event's time, None where nothing reported it.

    wanted (the first request held, by the router) → placed (the scheduler) → started (the
    engine process, by the agent) → healthy (the agent) → released (the router sent the held
    requests on) → first byte (the router had the first answer). A scale-up is wanted when placed.
    """

    replica_id: str
    model: str
    cause: str  # wake | scale-up
    placed_at: datetime
    wanted_at: datetime | None = None
    started_at: datetime | None = None
    healthy_at: datetime | None = None
    released_at: datetime | None = None
    first_byte_at: datetime | None = None
    requests: int = 0  # requests held for it (0: none known)
    waits_s: tuple[float, ...] = ()  # each held request's wait until released (sorted, the first 1,024)
    # Its agent fetched its files before starting the engine (placed → fetching → started): the download
    # phase. None: they were on the node (cached), or its agent keeps no files.
    fetching_at: datetime | None = None

    @property
    def download_s(self) -> float | None:
        """How long its files took to fetch; None when nothing was fetched or it has not started."""
        if self.fetching_at is None or self.started_at is None:
            return None
        return (self.started_at - self.fetching_at).total_seconds()

    @property
    def total_s(self) -> float | None:
        """From wanted (else placed) to the first byte (else healthy); None until healthy."""
        end = self.first_byte_at or self.healthy_at
        return None if end is None else (end - (self.wanted_at or self.placed_at)).total_seconds()


class ModelDetail(msgspec.Struct, frozen=True, kw_only=True):
    """``ctl model show``: a model's spec (the plan's figures in it), its replicas and its latest control events."""

    now: datetime | None
    positions: dict[str, int]
    summary: ModelSummary
    spec: ModelSpec
    replicas: tuple[ReplicaRow, ...]
    events: tuple[ModelEvent, ...]
    # Its cold starts, oldest first (the latest 64), and how many the history holds in all.
    cold_starts: tuple[ColdStart, ...] = ()
    cold_start_count: int = 0


class ClassGpuUse(msgspec.Struct, frozen=True, kw_only=True):
    """What the GPUs of one class are doing, from the agents' latest samples of live nodes."""

    gpu_class: str
    sampled: int  # GPUs with a recent sample
    utilization_pct: float | None  # mean over the sampled GPUs that report it; None: none does
    memory_used_mib: int
    memory_total_mib: int


class NodeGpus(msgspec.Struct, frozen=True, kw_only=True):
    """One node's latest GPU samples (processes left out) and when its agent took them."""

    node: str
    gpu_class: str
    at: datetime
    gpus: tuple[GpuSample, ...]
    # GPUs the fold holds unhealthy (an XID, ECC, lost from the bus), index → why: never drawn as idle.
    unhealthy: dict[int, str] = {}


class TenantUsage(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's API keys, summed: requests and tokens today (UTC) and over the last seven days."""

    tenant: str  # "" for keys without one
    requests_today: int
    tokens_today: int
    requests_7d: int
    tokens_7d: int


class KeyNearLimit(msgspec.Struct, frozen=True, kw_only=True):
    """A key that has used 80 % or more of its tokens for today (UTC)."""

    name: str
    tenant: str
    tokens_today: int
    tokens_per_day: int


class UsageRow(msgspec.Struct, frozen=True, kw_only=True):
    """What one key, tenant, model or adapter asked over the days asked about; ``throttled`` (429) and
    ``forbidden`` (403) are of the ``errors``."""

    name: str
    requests: int
    errors: int
    throttled: int
    forbidden: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class UsageTable(msgspec.Struct, frozen=True, kw_only=True):
    """``ctl usage`` from the running projector: its DuckDB rows as committed up to ``positions``."""

    by: str
    since_days: int
    positions: dict[str, int]
    rows: tuple[UsageRow, ...] = ()


class StatusReport(msgspec.Struct, frozen=True, kw_only=True):
    """The fleet at ``now``, computed only from the events folded up to ``positions``."""

    now: datetime | None
    idle_threshold_s: float
    positions: dict[str, int]
    nodes: int
    lost_nodes: tuple[str, ...]
    capacity: tuple[ClassCapacity, ...]
    free_nodes: tuple[FabricNodes, ...]
    models: int
    replicas: int
    replicas_by_state: dict[str, int]
    unplaceable: tuple[UnplaceableModel, ...]
    idle: tuple[IdleReplica, ...]
    unknown_idle: int
    unprojected_events: int
    # Each declared model: serving, starting, parked (a request wakes it), unplaceable or stopped.
    model_states: dict[str, str] = {}
    model_list: tuple[ModelSummary, ...] = ()
    replica_list: tuple[ReplicaRow, ...] = ()  # only when asked (``StatusRequest.replicas``)
    model_detail: ModelDetail | None = None  # only when asked (``StatusRequest.model``), and declared
    # Events folded at the time their stream stored them: their own was too far from it.
    clamped_events: int = 0
    # GPU use from the agents' latest heartbeats (live only: empty in a replay): per class, and
    # per node when the request asked for ``gpus``.
    gpu_use: tuple[ClassGpuUse, ...] = ()
    node_gpus: tuple[NodeGpus, ...] = ()
    # The API keys' use by tenant (ctl key), and the keys near their daily token limit.
    tenants: tuple[TenantUsage, ...] = ()
    near_limits: tuple[KeyNearLimit, ...] = ()
    # Every GPU some replica holds, with who booked how much of it: only when asked, with ``replicas``.
    gpu_bookings: tuple[GpuBooking, ...] = ()
    adapters: tuple[AdapterStatus, ...] = ()  # every declared LoRA adapter, and who holds it
    # Nodes nothing new is placed on, with why ("draining: …", "quarantine: …", or the operator's reason).
    cordoned: dict[str, str] = {}
    # Per node, how many times its GPUs went unhealthy in the last 24 h (only nodes with any).
    gpu_faults: dict[str, int] = {}
    usage: UsageTable | None = None  # only when asked (``StatusRequest.usage_by``), from a projector with a file
    # The control plane (``llmgw up``) as its own stops and starts tell it: "up" since its last start,
    # "down" since its recorded stop (or, looking back, since it was last seen before a kill -9): then no
    # replica serves (each reads "down") and no GPU-hours count; "": no such event was ever stored.
    control_plane: str = ""
    control_plane_since: datetime | None = None


STATUS_REPORT_DECODER = msgspec.json.Decoder(StatusReport)
STATUS_REQUEST_DECODER = msgspec.json.Decoder(StatusRequest)
