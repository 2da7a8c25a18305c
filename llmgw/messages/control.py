"""The control stream (``llmgw.control.*``): models, replicas, API keys, nodes cordoned, the control plane's stops and starts."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from llmgw.messages.base import (
    MAX_GPUS,
    MAX_REPLICAS,
    Event,
    FabricRef,
    GpuClassRef,
    GpuIndex,
    Label,
    ModelName,
    Parallel,
    Ref,
    ReplicaId,
    Replicas,
    Seconds,
    Split,
    Text,
    Time,
)
from llmgw.messages.fleet import MIB_MAX

# --- control stream: llmgw.control.model.<name>.*, llmgw.control.replica.<id>.* --

Engine = Literal["vllm", "llama.cpp"]


Routing = Literal["prefix", "least-outstanding"]
Roll = Literal["surge", "in-place"]

# vLLM's --dtype, the type weights and activations compute in; "auto" is the checkpoint's own.
Dtype = Literal["auto", "float16", "bfloat16", "float32"]


AdapterFormat = Literal["peft", "gguf"]
MAX_ADAPTERS = 1024  # declared per base, and attached to one llama.cpp replica at most


class AdapterRef(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """An adapter a llama.cpp replica attaches at its start (``--lora``): its name and file."""

    name: ModelName
    path: Text


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
    # vLLM --dtype: a 16-bit precision other than the checkpoint's own (an fp16 plan of a bf16
    # checkpoint); "auto", as every spec ran before the field, runs the checkpoint's.
    dtype: Dtype = "auto"
    kv_tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = 0  # the plan's KV cache per replica, in tokens: what an observation is checked against
    # The plan's KV cache per GPU, GiB: what a vLLM on a simulated card's CPU is given as
    # --kv-cache-memory-bytes (0: declared before plans carried it; vLLM's own default then).
    kv_gib_per_gpu: Annotated[float, msgspec.Meta(ge=0, le=1 << 20)] = 0.0
    # Sequences served at once. llama.cpp: -np slots, each with ``context`` (-c is their shared
    # pool, parallel x context); vLLM: --max-num-seqs (its paged cache needs no more memory).
    parallel: Parallel = 0
    engine_version: Label = ""  # the engine version the plan was made for ("": not recorded)
    # How routers pick its replica (llmgw/router/prefix.py): "prefix" sends prompts that begin alike
    # to the same replica (its KV cache has them), within a load bound; "least-outstanding" by load alone.
    routing: Routing = "prefix"
    # How a spec change replaces its replicas: "surge" starts each new one beside an old one and
    # stops the old once the new is healthy, waiting (the old serving) while there is no room;
    # "in-place" stops an old one first when there is no room: the operator's choice of downtime.
    roll: Roll = "surge"
    # Whole GPUs, nothing beside it (as every replica was placed before GPUs were shared). Otherwise a
    # replica books on each GPU what its plan needs there (``llmgw.fleet.state.booking_mib``) and
    # shares the card with others whose bookings fit beside it.
    exclusive: bool = False
    # LoRA adapters. vLLM: up to ``max_adapters`` loaded at once (--max-loras) of rank up to
    # ``max_lora_rank``, loaded where they are asked for; llama.cpp: ``adapters`` attached at start
    # (every adapter declared on this base: adding one re-declares the base, which rolls it).
    max_adapters: Annotated[int, msgspec.Meta(ge=0, le=MAX_ADAPTERS)] = 0
    max_lora_rank: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    adapters: Annotated[tuple[AdapterRef, ...], msgspec.Meta(max_length=MAX_ADAPTERS)] = ()

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


class ModelPrefetchRequested(Event, tag="ModelPrefetchRequested", frozen=True, kw_only=True):
    """An operator asked nodes to fetch a model's files before any replica needs them (``ctl model
    prefetch``); each node's agent acts for its own node only."""

    name: Ref
    nodes: Annotated[tuple[Ref, ...], msgspec.Meta(max_length=MAX_GPUS)] = ()  # (): every node
    revision: Label = ""  # "": the hub's main


class ModelPinned(Event, tag="ModelPinned", frozen=True, kw_only=True):
    """An operator said a model's files stay on disk whatever the budget (``ctl model pin``), or no longer."""

    name: Ref
    pinned: bool = True


class GpuRef(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU a replica holds."""

    node: Ref
    index: GpuIndex
    uuid: Label
    # MiB the replica booked on this GPU; 0: the whole card (placed before GPUs were shared).
    mib: Annotated[int, msgspec.Meta(ge=0, le=MIB_MAX)] = 0


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


# An engine's API key: URL-safe, what ``secrets.token_urlsafe(32)`` gives (43 characters); bounded at decode.
EngineKey = Annotated[str, msgspec.Meta(min_length=32, max_length=128, pattern=r"^[A-Za-z0-9_-]+\Z")]


class EngineKeyIssued(Event, tag="EngineKeyIssued", frozen=True, kw_only=True):
    """An agent gave a replica's engine on its node a new API key, before starting it (each start a new one).

    Published on its own stream (``llmgw.enginekey.<replica>.<node>``, the latest per subject), which only
    routers (and admin) may read: the key is what lets a request past the router, so no other role learns it.
    """

    replica_id: Ref
    node: Ref
    key: EngineKey
    endpoint: Label  # where the router reaches that engine (ReplicaStateChanged's, once it is healthy)
    # Which start of the engine it is for (the agent's restart count), so that a reader keeps the newest.
    restarts: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0


EngineKeyEvent = EngineKeyIssued


# A replica whose engine uses more than this over what it booked is reported (``ReplicaOverBooked``).
OVERBOOK_MARGIN = 0.10


class ReplicaOverBooked(Event, tag="ReplicaOverBooked", frozen=True, kw_only=True):
    """An agent saw a replica's engine hold more GPU memory on its node than the replica booked there,
    by more than ``OVERBOOK_MARGIN``: the figures the planner's corrections learn from, and what an
    operator must know before the card's other tenants run out of memory."""

    replica_id: Ref
    model: Ref
    node: Ref
    booked_mib: Annotated[int, msgspec.Meta(ge=0, le=MIB_MAX)]  # on this node, over its GPUs
    used_mib: Annotated[int, msgspec.Meta(ge=0, le=MIB_MAX)]  # what its engine's processes hold there
    source: Label = "nvml"  # nvml | rss (a simulated GPU: the process tree's resident memory)


# Why a replica stops, as a code the scheduler decides on and analysts group by; ``reason`` is the
# sentence for people. "" on events written before codes (readers derive one: ``stop_code``).
STOP_CODES = ("idle", "scaled_down", "spec_changed", "drained", "removed", "gpu_unhealthy", "node_lost", "engine_failed",
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
KeyScope = Literal["client", "viewer", "admin"]


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
    # What it opens besides the routers (which take any live key): "viewer" the dashboard's view of
    # the fleet, "admin" that and the tenants' names and usage; "client" no dashboard.
    scope: KeyScope = "client"


class NodeCordoned(Event, tag="NodeCordoned", frozen=True, kw_only=True):
    """Nothing new is placed on a node (``ctl node cordon``); with ``drain``, its replicas move off it one
    by one, each new one healthy elsewhere before the old one stops (``ctl node drain``). The scheduler
    cordons a node itself (``by`` = "quarantine") when it loses GPUs to fatal faults."""

    node: Ref
    reason: Text = ""
    drain: bool = False
    by: Label = "operator"  # operator | quarantine


class NodeUncordoned(Event, tag="NodeUncordoned", frozen=True, kw_only=True):
    """A cordoned node takes new replicas again (``ctl node uncordon``)."""

    node: Ref


class AdapterSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A LoRA adapter as its files state it (``llmgw.planner.adapters.read``), and the base it runs on."""

    name: ModelName  # what a request's ``model`` names; never a model's name too
    base: Ref  # the declared model it is trained for
    source: Text  # as the operator gave it: a directory, a file, or a repo id
    path: Text  # where an engine reads it from (the resolved directory or file)
    format: AdapterFormat
    rank: Annotated[int, msgspec.Meta(ge=1, le=1024)]
    alpha: Annotated[float, msgspec.Meta(gt=0, le=1 << 20)]
    target_modules: Annotated[tuple[Label, ...], msgspec.Meta(max_length=64)] = ()
    size_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 44)] = 0
    scale: Annotated[float, msgspec.Meta(ge=0, le=100)] = 1.0  # llama.cpp's per-request scale


class AdapterDeclared(Event, tag="AdapterDeclared", frozen=True, kw_only=True):
    """An operator declared a LoRA adapter (``ctl adapter add``)."""

    spec: AdapterSpec


class AdapterRemoved(Event, tag="AdapterRemoved", frozen=True, kw_only=True):
    """An operator removed an adapter; no router sends requests for it any more."""

    name: Ref


class KeyRevoked(Event, tag="KeyRevoked", frozen=True, kw_only=True):
    """An API key no router accepts any more (``ctl key revoke``); its usage stays in history."""

    name: Ref


class ControlPlaneStopped(Event, tag="ControlPlaneStopped", frozen=True, kw_only=True):
    """``llmgw up`` is stopping (SIGTERM, Ctrl-C): published before its bus and its parts go, so that from
    ``at`` until the next ``ControlPlaneStarted`` the fold knows nothing served and no GPU was held."""

    boot_id: Label
    reason: Text = ""


class ControlPlaneStarted(Event, tag="ControlPlaneStarted", frozen=True, kw_only=True):
    """``llmgw up`` started. After a stop it could not record (kill -9, a power cut) ``last_seen`` is when the
    one before was last seen alive: the gap from then to ``at`` is known down, as a recorded stop's is."""

    boot_id: Label
    previous_boot_id: Label = ""
    last_seen: Time | None = None


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
    | ReplicaOverBooked
    | AdapterDeclared
    | AdapterRemoved
    | ModelPrefetchRequested
    | ModelPinned
    | NodeCordoned
    | NodeUncordoned
    | ControlPlaneStopped
    | ControlPlaneStarted
)
