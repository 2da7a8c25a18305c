"""The one schema: every event, command and API body llmgw puts on the bus.

Events are facts in the past tense, frozen keyword-only msgspec Structs in
tagged unions, one union per stream. They evolve only by adding fields with
defaults; a breaking change is a new tag. ``v`` says which schema version wrote
an event; a reader accepts newer versions and ignores fields it does not know.

Longer than the 600 lines other modules keep to, on purpose: one file is the whole
schema (with the bounds every field is decoded under), so a reader sees every
shape on the bus in one place and no two modules can define the same one.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Literal

import msgspec

SCHEMA_VERSION = 1

# --- bounds: every number and string a decoder accepts -----------------------------
#
# One event out of range must never stop a reader: the projector's DuckDB columns
# (INTEGER, BIGINT), its msgpack checkpoint (64-bit integers) and the scheduler's
# loops all have limits, so every integer and string is bounded here, where bytes
# become Structs; an event outside is refused by the decoder, recorded and skipped.

# Names (nodes, models, routers; a replica id is a model name + ``-rN``): 1 to 128
# letters, digits, ``.``, ``_`` or ``-``, starting with a letter or digit. No space,
# newline or other character a subject token, a shell or a table would mangle. A model
# name (and so a replica id) may also have ``/`` between parts: ``org/model``, as Hugging
# Face and OpenAI clients write the model they ask for. Subjects and file names carry
# names through ``subjects.token``, which encodes what is not a letter, digit, _ or -.
NAME_MAX = 128
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z"  # \Z: "$" would let a trailing newline through
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*\Z"
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=NAME_MAX, pattern=NAME_PATTERN)]
ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=NAME_MAX, pattern=MODEL_NAME_PATTERN)]
NAME_RULE = f"1 to {NAME_MAX} letters, digits, '.', '_' or '-', starting with a letter or digit"
MODEL_NAME_RULE = f"{NAME_RULE}, or such parts joined by '/' (org/model)"
_NAME = re.compile(NAME_PATTERN)
_MODEL_NAME = re.compile(MODEL_NAME_PATTERN)


def name_problem(name: str, what: str = "a name", *, model: bool = False) -> str | None:
    """Why ``name`` breaks the names rule (for an error message), or None when it follows it."""
    if len(name) <= NAME_MAX and (_MODEL_NAME if model else _NAME).match(name):
        return None
    shown = repr(name) if len(name) <= 60 else f"{name[:40]!r}… ({len(name):,} characters)"
    return f"{what} must be {MODEL_NAME_RULE if model else NAME_RULE} (got {shown})"


ReplicaId = Annotated[str, msgspec.Meta(min_length=1, max_length=NAME_MAX + 24, pattern=MODEL_NAME_PATTERN)]
# A name where an event refers to one (a replica's node, a scaled model): bounded in length only.
# The rule is checked where a name enters the fleet (an inventory, a declaration, a placement, a
# router's map), so a reference outside it matches nothing and is ignored; a pattern per reference
# would cost the hot events (replica states, health changes) half their decoding time.
Ref = Annotated[str, msgspec.Meta(min_length=1, max_length=NAME_MAX + 24)]
# A GPU class where a node reports it (an inventory): a model, '-', its memory in GB (H100-80GB),
# as nvml.gpu_class derives it and a fleet file must write it. Where a declaration names a class,
# the names rule is enough: a class no GPU reports matches nothing. A fabric follows the names
# rule, as all detection makes (nvl-<NVLink cluster uuid>-<clique>, ib-<InfiniBand subnet prefix>,
# the node's name) does; a placement on one node has none (""). Bounded here because both are
# shown as they came (status tables, the dashboard) and key the planner's pools.
GPU_CLASS_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,120}-\d{1,6}GB\Z"
GPU_CLASS_MAX = 130  # what the pattern admits
GpuClass = Annotated[str, msgspec.Meta(max_length=GPU_CLASS_MAX, pattern=GPU_CLASS_PATTERN)]
GpuClassRef = Annotated[str, msgspec.Meta(min_length=1, max_length=GPU_CLASS_MAX, pattern=NAME_PATTERN)]
# A fabric as the names rule has it, and ':' '/' '@' '+' besides, which operators' own fabric names
# (--fabric, a fleet file) used before it was bounded ("rack1:ib"); nothing a page could run.
FABRIC_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*\Z"
FABRIC_RULE = f"1 to {NAME_MAX} of letters, digits, '.', '_', '-', ':', '/', '@', '+', starting with a letter or digit"
_FABRIC = re.compile(FABRIC_PATTERN)
Fabric = Annotated[str, msgspec.Meta(min_length=1, max_length=NAME_MAX, pattern=FABRIC_PATTERN)]
FabricRef = Annotated[str, msgspec.Meta(max_length=NAME_MAX, pattern=r"^(?:[A-Za-z0-9][A-Za-z0-9._:/@+-]*)?\Z")]


def fabric_problem(fabric: str) -> str | None:
    """Why ``fabric`` cannot name a fabric (for an error message), or None."""
    if len(fabric) <= NAME_MAX and _FABRIC.match(fabric):
        return None
    shown = repr(fabric) if len(fabric) <= 60 else f"{fabric[:40]!r}… ({len(fabric):,} characters)"
    return f"a fabric must be {FABRIC_RULE} (got {shown})"
Label = Annotated[str, msgspec.Meta(max_length=256)]  # ids, versions, addresses
Text = Annotated[str, msgspec.Meta(max_length=4096)]  # reasons and details for people; paths
Reasons = Annotated[tuple[Text, ...], msgspec.Meta(max_length=64)]
# An aware time: a naive one cannot be compared with the others, and the fold compares them all.
Time = Annotated[datetime, msgspec.Meta(tz=True)]
MAX_GPUS = 4096  # per node; an index, a tp, a pp
MAX_REPLICAS = 10_000
GpuIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_GPUS)]
Split = Annotated[int, msgspec.Meta(ge=1, le=MAX_GPUS)]  # tp, pp
Replicas = Annotated[int, msgspec.Meta(ge=0, le=MAX_REPLICAS)]
MAX_PARALLEL = 4096  # sequences one replica serves at once (llama.cpp's -np, vLLM's --max-num-seqs)
# 0: the engine's default (vLLM); llama.cpp always gets -np, 1 when unset.
Parallel = Annotated[int, msgspec.Meta(ge=0, le=MAX_PARALLEL)]
Seq = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # stream sequences, ticks: DuckDB BIGINT
Seconds = Annotated[float, msgspec.Meta(ge=0, le=10 * 365 * 86400)]
Dim = Annotated[int, msgspec.Meta(ge=0, le=1 << 30)]  # a model's sizes and counts (config.json)


def utcnow() -> datetime:
    """The publisher's clock; folds never call it, they take ``at`` from events."""
    return datetime.now(UTC)


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every event: when it happened, and which schema wrote it."""

    at: Time
    v: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = SCHEMA_VERSION


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


FleetEvent = NodeInventoryReported | GpuHealthChanged | NodeLost | NodeReturned | NodeRetired


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


# --- usage stream: llmgw.usage.<router>.idle ---------------------------------


class ModelLoad(msgspec.Struct, frozen=True, kw_only=True):
    """One model's demand at one router, at one tick."""

    in_flight: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    queued: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    replicas: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 0


_TokenCount = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]


class CacheUse(msgspec.Struct, frozen=True, array_like=True):
    """Prompt tokens a replica's engine reported over a router's tick, and how many it had cached."""

    model: Ref
    prompt_tokens: _TokenCount
    cached_tokens: _TokenCount


class KeyUse(msgspec.Struct, frozen=True, kw_only=True):
    """One API key's use of one model over a router's tick (what its engines' usage said)."""

    requests: _TokenCount = 0
    errors: _TokenCount = 0  # answered 4xx or 5xx
    prompt_tokens: _TokenCount = 0
    completion_tokens: _TokenCount = 0
    cached_tokens: _TokenCount = 0
    ttft_s: Annotated[float, msgspec.Meta(ge=0, le=1e12)] = 0.0  # summed over its streamed requests
    latency_s: Annotated[float, msgspec.Meta(ge=0, le=1e12)] = 0.0  # summed over its requests


class IdleMapPublished(Event, tag="IdleMapPublished", frozen=True, kw_only=True):
    """One router's last request time per replica, once a tick.

    A replica the router has not served since it started is absent: unknown is
    not idle.
    """

    router: Name
    boot_id: Label
    tick: Seq
    # Replica ids as keys are plain strings: only looked up, never taken as a name, and bounded by
    # the message (NATS max_payload); a length check per key costs 40% of this stream's decoding.
    last_request: dict[str, Time] = {}
    # Replicas in this router's pool with no request since it started routing
    # to them, and since when: "nobody asked since X", never "idle forever".
    serving_since: dict[str, Time] = {}
    # Demand, for the scheduler's autoscaler: per model this router knows, requests
    # in flight to its replicas plus requests held while it wakes, and how many
    # healthy replicas it routes to; per replica, requests in flight (non-zero only),
    # so a scale-down never picks a replica in the middle of a request.
    load: dict[Ref, ModelLoad] = {}
    busy: dict[str, Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]] = {}
    tick_s: Seconds = 0.0  # the router's tick: how soon its load is stale
    # The last control-stream sequence the router had applied: a sample taken before a
    # model's replica count last changed says nothing about the new count.
    control_seq: Seq = 0
    # Per replica that answered with ``usage`` since this router's previous map (carried over when
    # a map is not published): its prompt tokens and the engine's cached share of them (issue 27).
    cache_use: Annotated[dict[Ref, CacheUse], msgspec.Meta(max_length=4096)] = {}
    # Per API key (ctl key) and model, what was asked through this router since its previous map.
    callers: Annotated[dict[Ref, Annotated[dict[Ref, KeyUse], msgspec.Meta(max_length=4096)]],
                       msgspec.Meta(max_length=100_000)] = {}


class ModelWanted(Event, tag="ModelWanted", frozen=True, kw_only=True):
    """A router holds requests for a declared model that has no healthy replica.

    ``control_seq`` is the last control-stream sequence the router had applied:
    the scheduler wakes idle stops at or before it, so the answer does not
    depend on how the usage and control streams interleave in a replay.
    """

    router: Name
    boot_id: Annotated[str, msgspec.Meta(max_length=64)]
    model: Ref
    control_seq: Seq
    waiting: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 1


class WakeAnswered(Event, tag="WakeAnswered", frozen=True, kw_only=True):
    """A router sent on the requests it held for a parked model, and the first of them was answered.

    The router's part of a cold start (the ledger, ``ctl model show``): ``held_since`` is when
    the first request was held (the model was wanted), ``released_at`` when a healthy replica
    let them go on, ``at`` when the first byte of an answer came back from ``replica_id``.
    Published on ``llmgw.usage.<router>.wanted`` with the router's next idle map.
    """

    router: Name
    boot_id: Annotated[str, msgspec.Meta(max_length=64)]
    model: Ref
    replica_id: Ref
    held_since: Time
    released_at: Time
    requests: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 1
    # Each released request's wait from being held to going on, seconds (the first 1,024).
    waits_s: Annotated[tuple[Seconds, ...], msgspec.Meta(max_length=1024)] = ()


UsageEvent = IdleMapPublished | ModelWanted | WakeAnswered


# --- control stream: llmgw.control.model.<name>.*, llmgw.control.replica.<id>.* --

Engine = Literal["vllm", "llama.cpp"]


Routing = Literal["prefix", "least-outstanding"]


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything needed to run one replica of a declared model."""

    name: ModelName
    source: Text
    precision: Label
    engine: Engine
    gpu_class: GpuClassRef
    context: Annotated[int, msgspec.Meta(ge=0, le=1 << 30)]
    tp: Split = 1
    pp: Split = 1
    replicas: Replicas = 1
    quantization: Label | None = None
    file: Text | None = None
    gpu_memory_utilization: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.9
    engine_args: Annotated[tuple[Text, ...], msgspec.Meta(max_length=256)] = ()
    gib_per_gpu: Annotated[float, msgspec.Meta(ge=0, le=1 << 20)] = 0.0
    idle_ttl_s: Seconds | None = None
    # Autoscaling (both bounds set): the scheduler keeps between min and max replicas,
    # aiming at ``target_in_flight`` requests per replica; min 0 scales to zero and a
    # request wakes it. Unset: ``replicas`` is fixed, as before.
    min_replicas: Replicas | None = None
    max_replicas: Annotated[int, msgspec.Meta(ge=1, le=MAX_REPLICAS)] | None = None
    target_in_flight: Annotated[float, msgspec.Meta(gt=0, le=100_000)] = 4.0
    kv_cache_dtype: Label = "auto"  # vLLM --kv-cache-dtype (fp8 halves the cache)
    kv_tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = 0  # the plan's KV cache per replica, in tokens: what an observation is checked against
    # Sequences served at once. llama.cpp: -np slots, each with ``context`` (-c is their shared
    # pool, parallel x context); vLLM: --max-num-seqs (its paged cache needs no more memory).
    parallel: Parallel = 0
    engine_version: Label = ""  # the engine version the plan was made for ("": not recorded)
    # How routers pick its replica (llmgw/prefixroute.py): "prefix" sends prompts that begin alike
    # to the same replica (its KV cache has them), within a load bound; "least-outstanding" by load alone.
    routing: Routing = "prefix"

    @property
    def slots(self) -> int:
        """llama.cpp's -np: one slot unless more were asked for."""
        return max(1, self.parallel)

    @property
    def kv_tokens_planned(self) -> int:
        """The KV cache its engine should report: llama.cpp allocates exactly its -c (slots x context),
        whatever else the card holds (older declarations recorded the card's capacity)."""
        return self.context * self.slots if self.engine == "llama.cpp" else self.kv_tokens

    @property
    def autoscaled(self) -> bool:
        return self.min_replicas is not None and self.max_replicas is not None


class ModelDeclared(Event, tag="ModelDeclared", frozen=True, kw_only=True):
    """An operator asked for a model to serve with this spec."""

    spec: ModelSpec


class ModelScaled(Event, tag="ModelScaled", frozen=True, kw_only=True):
    """An operator changed how many replicas a model should have."""

    name: Ref
    replicas: Replicas


class ModelAutoscaled(Event, tag="ModelAutoscaled", frozen=True, kw_only=True):
    """The scheduler changed how many replicas an autoscaled model has, and says why."""

    name: Ref
    replicas: Replicas
    reason: Text = ""
    code: Label = ""  # AUTOSCALE_CODES; "" before codes


class ModelRemoved(Event, tag="ModelRemoved", frozen=True, kw_only=True):
    """An operator asked for a model to stop serving everywhere."""

    name: Ref


class ModelUnplaceable(Event, tag="ModelUnplaceable", frozen=True, kw_only=True):
    """The scheduler could not place replicas of a model, and says why."""

    name: Ref
    reason: Text
    missing_replicas: Replicas = 1
    code: Label = ""  # UNPLACEABLE_CODES; "" before codes


class GpuRef(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU a replica holds."""

    node: Ref
    index: GpuIndex
    uuid: Label


class ReplicaPlaced(Event, tag="ReplicaPlaced", frozen=True, kw_only=True):
    """The scheduler put a replica on these GPUs (tp per node, pp nodes)."""

    replica_id: ReplicaId
    model: Ref
    nodes: Annotated[tuple[Ref, ...], msgspec.Meta(max_length=MAX_GPUS)]
    gpus: Annotated[tuple[GpuRef, ...], msgspec.Meta(max_length=MAX_GPUS * 16)]
    spec: ModelSpec
    fabric: FabricRef = ""
    reason: Text = ""
    # Why the scheduler placed it, as a code: "wake" (a request woke a parked model), "scale-up"
    # (the autoscaler asked for more), "" (a declaration, a re-placement, a roll). The cold-start
    # ledger counts the first two; older events carry "" and are judged by their reason.
    cause: Label = ""


ReplicaState = Literal["starting", "healthy", "unhealthy", "failed", "stopped"]


class ReplicaStateChanged(Event, tag="ReplicaStateChanged", frozen=True, kw_only=True):
    """An agent reports how the engine of a replica is doing."""

    replica_id: Ref
    model: Ref
    node: Ref
    state: ReplicaState
    endpoint: Label = ""
    detail: Text = ""
    restarts: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    # What a healthy engine actually reserved for KV cache, in tokens (vLLM: num_gpu_blocks x
    # block_size from /metrics); 0 when unknown. Bounded only to what a checkpoint can hold:
    # a figure out of a sane range must not cost the state change; the planner ignores and counts it.
    observed_kv_tokens: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] = 0
    # A replica over several nodes (pp > 1): each node reports its own part; the head's part
    # (the first node) says where the others join it (Ray's head, host:port).
    head_address: Label = ""
    # GPU memory the engine's processes (and their children) hold on this node, as NVML lists them,
    # in MiB; 0 when unknown. Bounded as observed_kv_tokens is; readers clamp.
    observed_memory_mib: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] = 0


# Why a replica stops, as a code the scheduler decides on and analysts group by; ``reason`` is the
# sentence for people. "" on events written before codes (readers derive one: ``stop_code``).
STOP_CODES = ("idle", "scaled_down", "spec_changed", "removed", "gpu_unhealthy", "node_lost", "engine_failed",
              "requested")
# Why a model cannot be placed: no GPU of its class anywhere, or not enough free ones (or whole nodes).
UNPLACEABLE_CODES = ("no_such_class", "no_room")
# Why the autoscaler changed a count.
AUTOSCALE_CODES = ("woken", "scaled_up", "scaled_down", "bounds")


class ReplicaStopped(Event, tag="ReplicaStopped", frozen=True, kw_only=True):
    """A replica must stop and give its GPUs back (idle, removed, re-placed, …): ``code`` (STOP_CODES) and why."""

    replica_id: Ref
    model: Ref
    reason: Text
    code: Label = ""

    @property
    def stop_code(self) -> str:
        """The code, or for an event written before codes, the one its reason's wording implies."""
        if self.code:
            return self.code
        for prefix, code in STOP_PREFIXES:
            if self.reason.startswith(prefix):
                return code
        return ""


# How the scheduler worded each stop before codes (ctl idle --stop wrote "idle").
STOP_PREFIXES = (("idle", "idle"), ("scaled down", "scaled_down"), ("spec changed", "spec_changed"),
                  ("model removed", "removed"), ("failed", "engine_failed"),
                  ("re-placing: node", "node_lost"), ("re-placing: GPU", "gpu_unhealthy"))


# --- keys: llmgw.control.key.<name>.* (admin only) ------------------------------

KEY_PREFIX = "llmgw-"  # a secret is llmgw-<key id, 16 hex>-<secret, 43 url-safe base64>
KeyId = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{16}$", max_length=16)]
Hex64 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$", max_length=64)]
Hex32 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{32}$", max_length=32)]
Priority = Literal["high", "normal", "low"]


class KeyDeclared(Event, tag="KeyDeclared", frozen=True, kw_only=True):
    """An API key and its limits (``ctl key create|update``); the stream holds a salted digest, never the secret.

    Declared again under the same name it replaces the record (``update``); the digest is
    sha256(salt || secret) in hex, and a router finds the record by ``lookup_id`` (the id in the secret).
    """

    name: Ref
    lookup_id: KeyId
    salt: Hex32
    digest: Hex64
    tenant: Annotated[str, msgspec.Meta(max_length=128)] = ""
    models: Annotated[tuple[Ref, ...], msgspec.Meta(max_length=256)] = ()  # empty: every model
    requests_per_minute: Annotated[int, msgspec.Meta(ge=1, le=10**15)] | None = None
    tokens_per_day: Annotated[int, msgspec.Meta(ge=1, le=10**15)] | None = None
    priority: Priority = "normal"
    expires_at: Time | None = None


class KeyRevoked(Event, tag="KeyRevoked", frozen=True, kw_only=True):
    """An API key no router accepts any more (``ctl key revoke``); its usage stays in history."""

    name: Ref


ControlEvent = (
    KeyDeclared
    | KeyRevoked
    | ModelDeclared
    | ModelScaled
    | ModelAutoscaled
    | ModelRemoved
    | ModelUnplaceable
    | ReplicaPlaced
    | ReplicaStateChanged
    | ReplicaStopped
)

AnyEvent = FleetEvent | HeartbeatEvent | UsageEvent | ControlEvent


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


# --- service bodies (request/reply, not stored) -----------------------------


class ErrorReply(msgspec.Struct, frozen=True, kw_only=True, tag="error", tag_field="type"):
    """What a service answers to a request it cannot serve."""

    error: str
    code: int = 400


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


class ClassCapacity(msgspec.Struct, frozen=True, kw_only=True):
    """GPUs of one class: used + free + unhealthy + lost == total."""

    gpu_class: str
    total: int
    used: int
    free: int
    unhealthy: int
    lost: int = 0


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


class ModelSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One declared model at a glance: a row of ``ctl model list`` and of ``ctl status``.

    ``idle_s`` is since anyone asked for any of its replicas: -1 when a replica
    no router knows could have been asked (unknown is not idle) or none is placed.
    KV tokens: the plan's per replica, and what its engines last reported reserving
    since it was declared, kept when its replicas stop (0: none reported).
    """

    name: str
    state: str  # serving | starting | parked | unplaceable | stopped
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


class ReplicaRow(msgspec.Struct, frozen=True, kw_only=True):
    """One replica as the fold knows it; ``idle_s`` < 0: no router knows, ``kv_tokens_observed`` 0: not reported.

    ``kv_error`` is (planned - observed) / observed, as ``ctl model plan`` states the
    estimate's error; None when either is unknown.
    """

    replica_id: str
    model: str
    state: str  # placed | starting | healthy | unhealthy | failed
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


STATUS_REPORT_DECODER = msgspec.json.Decoder(StatusReport)
STATUS_REQUEST_DECODER = msgspec.json.Decoder(StatusRequest)


# --- plan service: llmgw.plan (request/reply) --------------------------------


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A model's architecture as its own config.json states it, and its parameter count."""

    name: Text  # repo id ("Qwen/Qwen2.5-14B-Instruct") or directory name
    source: Text  # what the engine loads: the repo id, or the local directory
    model_type: str
    architecture: str
    hidden_size: Dim
    intermediate_size: Dim
    num_layers: Dim
    num_attention_heads: Dim
    num_kv_heads: Dim
    head_dim: Dim
    vocab_size: Dim
    max_position_embeddings: Dim
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    attention_bias: bool = False
    sliding_window: Dim | None = None
    sliding_layers: Annotated[tuple[Dim, ...], msgspec.Meta(max_length=1 << 16)] = ()  # indices of the layers that attend within the window
    num_experts: Dim = 0
    experts_per_token: Dim = 0
    moe_intermediate_size: Dim = 0
    shared_experts: Dim = 0
    first_dense_layers: Dim = 0
    q_lora_rank: Dim = 0
    kv_lora_rank: Dim = 0  # > 0: multi-head latent attention (DeepSeek-V2/V3)
    qk_rope_head_dim: Dim = 0
    qk_nope_head_dim: Dim = 0
    v_head_dim: Dim = 0
    attn_output_gate: bool = False  # q_proj also projects a gate on the attention's output (Qwen3-Next, Qwen3.5)
    # Gemma 4: its full-attention layers have heads of another size and (with k_eq_v) fewer KV heads than
    # its sliding ones (0: the same as the others); its last layers may reuse earlier layers' KV cache;
    # its layers may run a dense MLP beside the experts; small ones add per-layer token embeddings (PLE).
    full_head_dim: Dim = 0
    full_kv_heads: Dim = 0
    kv_shared_layers: Dim = 0
    dense_and_moe: bool = False
    double_wide_shared: bool = False  # the KV-sharing layers' dense MLP is twice as wide
    per_layer_input_size: Dim = 0
    per_layer_vocab: Dim = 0
    # Hybrid models: layers of gated delta-net linear attention (Qwen3-Next, Qwen3.5) keep no KV per token,
    # only a fixed state per sequence: a convolution window and a heads x key x value recurrent state.
    linear_layers: Annotated[tuple[Dim, ...], msgspec.Meta(max_length=1 << 16)] = ()
    linear_qk_heads: Dim = 0  # heads of q and k (the config says "key heads")
    linear_value_heads: Dim = 0
    linear_qk_head_dim: Dim = 0
    linear_value_head_dim: Dim = 0
    linear_conv_kernel: Dim = 0
    linear_state_bytes: Annotated[int, msgspec.Meta(ge=0, le=8)] = 0  # per recurrent state element (fp32: 4)
    vision_params: Annotated[int, msgspec.Meta(ge=0, le=10**13)] = 0  # a multimodal model's vision tower, loaded by vLLM
    # What vLLM's start-up profiling runs through the tower (Qwen-VL-style towers): the largest image's
    # tokens and patches, and the activations per patch (3 x hidden + MLP width, elements).
    vision_item_tokens: Dim = 0
    vision_item_patches: Dim = 0
    vision_patch_width: Dim = 0
    # The checkpoint's own precision when it is pre-quantized: fp8 | int8 | int4 | fp4 | awq | gptq |
    # bnb-4bit | bnb-8bit | None; with the bits each quantized weight takes (scales and zero points
    # included), the modules it leaves 16-bit (its ``ignore`` list), its format, and its KV cache dtype.
    quantization: str | None = None
    quant_bits: Annotated[float, msgspec.Meta(ge=0, le=64)] = 0.0
    quant_ignore: tuple[str, ...] = ()
    quant_format: str = ""  # compressed-tensors | fp8 | awq | gptq | bitsandbytes
    kv_cache_dtype: str = ""  # "fp8" when the checkpoint carries a kv_cache_scheme
    params: Annotated[int, msgspec.Meta(ge=0, le=10**16)] = 0
    params_source: str = ""  # safetensors-index | safetensors-header | hf-metadata | architecture | --params


class PlanRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Ask the planner how a model could be split over the fleet it knows."""

    model: Text
    precisions: Annotated[tuple[Label, ...], msgspec.Meta(max_length=32)] = ()  # empty: every precision the repository can be served at
    tp: Annotated[tuple[Split, ...], msgspec.Meta(max_length=32)] = ()  # empty: 1, 2, 4, 8 where the heads divide
    context: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)] | None = None  # None: the model's full context, else the largest that fits
    # None: the engine version's default (vLLM 0.9 before 0.29, 0.92 from it)
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    params: Annotated[int, msgspec.Meta(ge=1, le=10**16)] | None = None
    all: bool = False
    info: ModelInfo | None = None  # the model as the asker read it; None: the planner resolves it
    parallel: Parallel = 0  # llama.cpp: slots, each holding the context (its KV pool is parallel x context)
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"  # auto: the model's dtype, or the checkpoint's kv_cache_scheme
    # The vLLM version to plan for ("": the one the fleet's agents report, else the newest profile).
    engine_version: Label = ""
    # vLLM's --max-num-seqs (0: the version's default on each card); it sizes the sampler's profiling pass.
    max_num_seqs: Parallel = 0


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """One way to run one replica: where, how split, at which precision, and whether it fits."""

    gpu_class: str
    fabric: str | None  # None for a single-node replica: its node's fabric changes nothing
    nodes: int
    tp: int
    pp: int
    precision: str
    engine: Engine
    quantization: str | None
    fits: bool
    reason: str | None
    weights_gib_per_gpu: float
    kv_bytes_per_token_per_gpu: int
    kv_gib_per_gpu: float
    kv_tokens: int
    max_context: int
    replicas_now: int
    command: str
    source: str = ""
    context: int = 0  # the max_model_len the command sets
    gpus: int = 1
    gpu_memory_gib: float = 0.0
    gpu_memory_utilization: float = 0.9
    overhead_gib_per_gpu: float = 0.0
    file: str | None = None  # GGUF: the file to download
    file_gib: float | None = None
    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype
    # KV tokens an engine of this very spec reserved on this fleet (then kv_tokens is that
    # figure and the estimate is ``estimated_kv_tokens``); None: never run here.
    observed_kv_tokens: int | None = None
    estimated_kv_tokens: int = 0
    # Over several nodes: what each node runs, the head first (``command`` is the head's vLLM).
    node_commands: tuple[str, ...] = ()
    parallel: int = 0  # as asked (PlanRequest.parallel); llama.cpp's KV pool is max(1, parallel) x context
    engine_version: str = ""  # the engine version the plan was made for (vLLM; llama.cpp: as reported)
    engine_profile: str = ""  # the overhead profile used, e.g. "vllm 0.21–0.28"
    max_num_seqs: int = 0  # vLLM's --max-num-seqs, planned and passed
    cuda_graph_gib_per_gpu: float = 0.0  # vLLM's CUDA graphs, estimated (0 in eager mode)
    # budget: vLLM takes them from the budget (0.20+); slack: the 1 - utilization slack holds them;
    # charged: it could not, so the utilization was lowered until it does; eager: --enforce-eager
    cuda_graphs: str = ""
    graph_note: str | None = None  # why charged or eager, and what the other choice costs
    enforce_eager: bool = False

    def spec(self, name: str, replicas: int = 1) -> ModelSpec:
        """The declaration this candidate makes for the scheduler."""
        return ModelSpec(
            name=name,
            source=self.source,
            precision=self.precision,
            engine=self.engine,
            gpu_class=self.gpu_class,
            context=self.context,
            tp=self.tp,
            pp=self.pp,
            replicas=replicas,
            quantization=self.quantization,
            file=self.file,
            gpu_memory_utilization=self.gpu_memory_utilization,
            gib_per_gpu=round(self.weights_gib_per_gpu + self.overhead_gib_per_gpu + self.kv_gib_per_gpu, 2),
            kv_cache_dtype=self.kv_cache_dtype,
            # llama.cpp allocates exactly its -c (slots x context), whatever else the card would hold.
            kv_tokens=self.context * max(1, self.parallel) if self.engine == "llama.cpp" else self.kv_tokens,
            # vLLM runs with the --max-num-seqs it was planned for (its sampler's profiling pass depends on it).
            parallel=self.max_num_seqs if self.engine == "vllm" and self.max_num_seqs else self.parallel,
            engine_args=("--enforce-eager",) if self.enforce_eager else (),
            engine_version=self.engine_version,
        )


class PlanReply(msgspec.Struct, frozen=True, kw_only=True):
    """Every candidate for a model; the JSON that ``ctl model plan --json`` prints."""

    model: str
    params: int
    candidates: tuple[Candidate, ...]
    params_source: str = ""
    context: int | None = None
    fleet_gpus: int = 0
    notes: tuple[str, ...] = ()
    engine_version: str = ""  # the vLLM version planned for
    engine_profile: str = ""  # and the overhead profile that version uses
    engine_version_source: str = ""  # --engine-version | fleet | newest profile


PLAN_REQUEST_DECODER = msgspec.json.Decoder(PlanRequest)
PLAN_REPLY_DECODER = msgspec.json.Decoder(PlanReply)


# --- codecs, built once -------------------------------------------------------

ENCODER = msgspec.json.Encoder()
FLEET_DECODER = msgspec.json.Decoder(FleetEvent)
HEARTBEAT_DECODER = msgspec.json.Decoder(HeartbeatEvent)
USAGE_DECODER = msgspec.json.Decoder(UsageEvent)
CONTROL_DECODER = msgspec.json.Decoder(ControlEvent)
ANY_DECODER = msgspec.json.Decoder(AnyEvent)
ERROR_DECODER = msgspec.json.Decoder(ErrorReply)


# Everything a decoder raises on bytes it cannot use. Deep nesting (~1,000
# levels, even inside an unknown field) raises RecursionError, not DecodeError;
# a reader that did not catch it would die on the same event at every restart.
DECODE_ERRORS: tuple[type[Exception], ...] = (msgspec.DecodeError, RecursionError)


def encode(message: msgspec.Struct) -> bytes:
    """Bytes for the bus."""
    return ENCODER.encode(message)


def decode_event(data: bytes) -> AnyEvent:
    """An event from bytes of any stream; raises msgspec.DecodeError or ValidationError."""
    return ANY_DECODER.decode(data)
