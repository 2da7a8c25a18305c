"""The pure fold: ``apply(state, event)`` for every event of the history streams.

One fold serves the projector, the planner, the scheduler and ``ctl status
--replay``, so that they can never disagree. It reads no clock and does no I/O;
``at`` comes from the events. For speed it mutates the state it is given.

Each stream folds into its own part of the state (fleet → nodes, control →
models and replicas, usage → idle), and the views that join them (used, free,
idle) are computed when asked. So the result does not depend on how the
streams' events interleave, only on each stream's own order, which JetStream
fixes: a live projector and a fresh replay agree.

Over 600 lines: every event kind's fold is one ``match`` in ``apply``, beside the state it
folds into and the views over it; split, a reader checking one event would read two files.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Container, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import compress
from operator import attrgetter, ne
from typing import Any, TypeVar

import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.fleet.files import NodeFiles, fold_files

# Bumped whenever apply() folds any event differently, or a checkpoint carries more: a
# snapshot of the fold made by another version is not resumed from (llmgw/fleet/snapshots.py),
# it is folded again. 2: the models' history, the scheduler's and the planner's memory travel
# in it; 3: the routers' pool too; 4: the liveness monitor's lost nodes too; 6: the models'
# history carries the cold-start ledger, the pool each model's routing policy, and each
# replica the prompt tokens its engine had cached; the planner's observed reservations are
# keyed by the engine version their spec was planned for, and each node keeps its engines' versions;
# the API keys (ctl key); 7: the models' history keeps what a woken or scaled-up replica reserved;
# 8: an observed reservation is keyed by the engine arguments that sized it and never kept from a
# simulated node or an explicit cache size, and the models' history notes which node reported it.
# 9: a replica keeps its last ReplicaOverBooked, and a report of the state it is in keeps its state_at;
# 10: LoRA adapters (declared, and which replica holds which); 11: which node holds which model
# files, the downloads in flight and finished, and the pinned models (llmgw/fleet/files.py);
# 12: the models' history times each cold start's download (its agent fetching the files first);
# 13: when each model and adapter was last asked for (the routers' maps); 14: cordoned nodes;
# 15: each GPU's recent faults by UUID (``FleetState.faults``: quarantine after N in M minutes, placement);
# 16: when a replica last stopped on each GPU (``FleetState.released``: status drops NVML samples older).
# 17: the control plane's own stops and starts (``FleetState.plane_*``), and the models' history closes the
# GPU-time of the replicas it holds over a gap the control plane was down.
# 18: the control plane's latest gaps (``FleetState.plane_gaps``): idle time leaves them out.
FOLD_VERSION = 18

OBSERVED_MIB_MAX = 256 * m.MIB_MAX  # a node's GPUs at most; an agent's larger figure is ignored


@dataclass
class GpuView:
    node: str
    index: int
    uuid: str
    name: str
    gpu_class: str
    memory_mib: int
    healthy: bool = True
    reasons: tuple[str, ...] = ()
    since: datetime | None = None


@dataclass
class NodeView:
    name: str
    fabric: str
    fabric_source: str
    boot_id: str
    gpus: dict[int, GpuView]
    lost: bool = False
    lost_at: datetime | None = None
    simulated: bool = False
    updated_at: datetime | None = None
    # What the engines its agent starts say they are (its last inventory): what plans are made for.
    vllm_version: str = ""
    llamacpp_version: str = ""


@dataclass
class ModelView:
    spec: m.ModelSpec
    replicas_wanted: int
    declared_at: datetime
    unplaceable_reason: str | None = None
    unplaceable_at: datetime | None = None
    # Who set replicas_wanted last: "declared", "operator" (ctl model scale) or "autoscaler".
    replicas_by: str = "declared"


@dataclass
class ReplicaView:
    replica_id: str
    model: str
    nodes: tuple[str, ...]
    gpus: tuple[m.GpuRef, ...]
    fabric: str
    spec: m.ModelSpec
    placed_at: datetime
    state: str = "placed"  # placed | starting | healthy | unhealthy | failed
    state_at: datetime | None = None
    endpoint: str = ""
    detail: str = ""
    restarts: int = 0
    observed_kv_tokens: int = 0  # what its engine reserved, as its agent last reported (0: unknown)
    # Over several nodes: each node's part, as its own agent reports it. The replica is
    # healthy only when every part is; its endpoint is the head's (the first node).
    parts: dict[str, str] = field(default_factory=dict)
    head_address: str = ""
    # GPU memory its engine's processes hold, per node, as each node's agent last observed it (MiB).
    observed_memory_mib: dict[str, int] = field(default_factory=dict)
    # Where the control stream holds the placement and the report that set the endpoint: a reader
    # that starts from a snapshot checks both against the stream (llmgw.fleet.snapshots).
    placed_seq: int = 0
    endpoint_seq: int = 0
    # Prompt tokens its engine reported through every router's maps, and of them cached (issue 27).
    prompt_tokens: int = 0
    cached_tokens: int = 0
    overbooked: m.ReplicaOverBooked | None = None  # the last time its engine held more than it booked


@dataclass
class RouterView:
    boot_id: str
    tick: int
    at: datetime
    serving_since: dict[str, datetime] = field(default_factory=dict)
    # This router's own latest map, so the idle history can record only what changed.
    last_request: dict[str, datetime] = field(default_factory=dict)


@dataclass
class Cursor:
    """Where a reader of the history streams stands; kept beside a FleetState, never touched by ``apply``."""

    # The last sequence folded per stream, and events that could not be decoded (skipped).
    positions: dict[str, int] = field(default_factory=dict)
    unprojected: int = 0
    # Events folded at the time their stream stored them, their own being too far from it (``clamp_times``).
    clamped: int = 0
    # When JetStream created each stream read (its identity: a stream deleted and
    # declared again restarts at sequence 1 under the same name).
    stream_created: dict[str, str] = field(default_factory=dict)
    # When the server stored the message at each position (ns): where a snapshot sits in time.
    stored_ns: dict[str, int] = field(default_factory=dict)


@dataclass
class FleetState:
    """Everything the history streams say, as of the last event applied."""

    nodes: dict[str, NodeView] = field(default_factory=dict)
    models: dict[str, ModelView] = field(default_factory=dict)
    replicas: dict[str, ReplicaView] = field(default_factory=dict)
    routers: dict[str, RouterView] = field(default_factory=dict)
    last_request: dict[str, datetime] = field(default_factory=dict)
    as_of: datetime | None = None
    # API keys by name (ctl key …): the live ones; a revoked key is dropped (its usage stays in history).
    keys: dict[str, m.KeyDeclared] = field(default_factory=dict)
    # Per key, per UTC day (the last KEY_USAGE_DAYS): [requests, tokens] the routers' maps reported.
    key_usage: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    # LoRA adapters by name (ctl adapter), and per replica the adapters routers loaded into its
    # engine, with when (the usage stream's; a stopped replica's entry goes with its next unload or
    # when no router reports it: ``adapters_held`` joins it to the replicas that exist).
    adapters: dict[str, m.AdapterSpec] = field(default_factory=dict)
    # Nodes nothing new is placed on (ctl node cordon / drain, or the scheduler's quarantine).
    cordoned: dict[str, m.NodeCordoned] = field(default_factory=dict)
    uncordoned_at: dict[str, datetime] = field(default_factory=dict)  # an operator's last uncordon, per node
    # When each GPU (by UUID: an inventory rebuilds the GpuView) went from healthy to unhealthy, oldest first:
    # the last FAULT_DAYS, at most FAULTS_KEPT a GPU (``record_fault``).
    faults: dict[str, list[datetime]] = field(default_factory=dict)
    # When a replica booked on each GPU (by UUID) last stopped: an NVML sample from before it still counts
    # what its engine held (``llmgw.fleet.gpuuse``). One entry a GPU; a retired node's go with it.
    released: dict[str, datetime] = field(default_factory=dict)
    loaded: dict[str, dict[str, datetime]] = field(default_factory=dict)
    # When a router's map last said a model or adapter was asked for (by any caller, anonymous ones too),
    # for the last ASKED_DAYS: the usage stream's alone (``status.adapter_status`` joins it to the declared).
    asked: dict[str, datetime] = field(default_factory=dict)
    # Model files by node (NodeFilesReported), downloads in flight and the last finished, by node
    # then source; the models an operator pinned on disk (ctl model pin).
    files: dict[str, NodeFiles] = field(default_factory=dict)
    downloads: dict[str, dict[str, m.DownloadProgressed]] = field(default_factory=dict)
    downloaded: dict[str, dict[str, m.DownloadFinished]] = field(default_factory=dict)
    pinned: set[str] = field(default_factory=set)
    # The control plane (``llmgw up``) as its own events tell it: the boot that started last and when, and
    # since when it is down (a recorded stop; None while it runs, or when no such event was ever stored).
    plane_boot: str = ""
    plane_started_at: datetime | None = None
    plane_down_since: datetime | None = None
    # Its latest gaps (from, to), oldest first, PLANE_GAPS_KEPT at most: nobody could ask for anything in them.
    plane_gaps: list[tuple[datetime, datetime]] = field(default_factory=list)

    # --- derived views, computed when asked ----------------------------------

    def held_gpus(self) -> dict[tuple[str, int], str]:
        """(node, gpu index) → the replicas holding it (their ids, joined by ", ")."""
        out: dict[tuple[str, int], str] = {}
        for r in self.replicas.values():
            for g in r.gpus:
                key = (g.node, g.index)
                out[key] = f"{out[key]}, {r.replica_id}" if key in out else r.replica_id
        return out

    def ref_mib(self, ref: m.GpuRef) -> int:
        """MiB a replica booked on one of its GPUs: as placed, or the whole card for a placement
        from before GPUs were shared (a card no inventory names: as much as any card holds)."""
        if ref.mib:
            return ref.mib
        node = self.nodes.get(ref.node)
        gpu = node.gpus.get(ref.index) if node is not None else None
        return gpu.memory_mib if gpu is not None else m.MIB_MAX

    def booked(self) -> dict[tuple[str, int], int]:
        """(node, gpu index) → MiB the replicas on it booked, for every GPU some replica holds."""
        out: dict[tuple[str, int], int] = {}
        for r in self.replicas.values():
            for g in r.gpus:
                key = (g.node, g.index)
                out[key] = out.get(key, 0) + self.ref_mib(g)
        return out

    def gpu_replicas(self) -> dict[tuple[str, int], list[tuple[str, int]]]:
        """(node, gpu index) → [(replica id, MiB booked)], in placement order: who holds how much."""
        out: dict[tuple[str, int], list[tuple[str, int]]] = {}
        for r in sorted(self.replicas.values(), key=lambda r: (r.placed_at, r.replica_id)):
            for g in r.gpus:
                out.setdefault((g.node, g.index), []).append((r.replica_id, self.ref_mib(g)))
        return out

    def gpus(self) -> Iterator[GpuView]:
        for node in self.nodes.values():
            yield from node.gpus.values()

    def recent_faults(self, uuid: str, since: datetime) -> int:
        """How many times a GPU went unhealthy after ``since`` (of what the fold remembers)."""
        times = self.faults.get(uuid)
        return sum(1 for t in times if t > since) if times else 0

    def node_faults(self, node: NodeView, since: datetime) -> int:
        """Its GPUs' faults after ``since``, summed."""
        return sum(self.recent_faults(g.uuid, since) for g in node.gpus.values()) if self.faults else 0

    def usable(self, gpu: GpuView) -> bool:
        """Healthy on a node that is not lost: the only GPUs that are used or free."""
        return gpu.healthy and not self.nodes[gpu.node].lost

    def free_gpus(self, node: NodeView, held: Container[tuple[str, int]] | None = None) -> list[GpuView]:
        """Healthy GPUs of a live node that no replica holds: the one definition of a free whole
        GPU, for the planner's pools, the scheduler's placements and the status report (a GPU
        that holds small replicas has free memory, ``free_mib``, but is not a free GPU)."""
        if node.lost:
            return []
        held = self.held_gpus() if held is None else held
        return [g for g in node.gpus.values() if g.healthy and (node.name, g.index) not in held]

    def model_states(self, failing: Collection[str] = ()) -> dict[str, str]:
        """Each declared model's cold-start state (``model_state``); ``failing``: models whose engines the
        history saw fail since they were last healthy (a re-placed replica has not failed yet itself)."""
        healthy: dict[str, bool] = {}
        failed = set(failing)
        for r in self.replicas.values():
            healthy[r.model] = healthy.get(r.model, False) or r.state == "healthy"
            if r.state == "failed" or (r.state != "healthy" and r.restarts > 0):
                failed.add(r.model)
        return {name: model_state(healthy=healthy.get(name, False), placed=name in healthy,
                                  replicas_wanted=v.replicas_wanted, replicas_by=v.replicas_by,
                                  unplaceable=v.unplaceable_reason, failing=name in failed)
                for name, v in self.models.items()}

    def adapters_held(self, replica: ReplicaView) -> tuple[str, ...]:
        """The declared adapters a replica's engine holds: a llama.cpp replica those it attached at
        start, a vLLM replica those routers loaded into it since it was placed."""
        if replica.spec.adapters:
            return tuple(a.name for a in replica.spec.adapters if a.name in self.adapters)
        held = self.loaded.get(replica.replica_id, {})
        return tuple(sorted(a for a, at in held.items() if a in self.adapters and at >= replica.placed_at))

    def idle_since(self, replica_id: str) -> datetime | None:
        """Since when nobody has asked for a replica, or None when no router knows.

        The last request any router ever reported for this placement of the replica,
        else the earliest time a router's latest map says it began routing to it with no
        request since. A router's ``serving_since`` is no request: a router that starts
        (a new name: a rolled-out pod, another machine) has seen none, so it neither
        moves a last request nor restarts the idle time the other routers' maps give.
        Anything from before the replica was placed (its id's earlier life) is ignored.
        """
        replica = self.replicas.get(replica_id)
        placed = replica.placed_at if replica is not None else None
        last = self.last_request.get(replica_id)
        if last is not None and (placed is None or last >= placed):
            return last
        serving = [r.serving_since[replica_id] for r in self.routers.values() if replica_id in r.serving_since]
        if placed is not None:
            serving = [t for t in serving if t >= placed]
        return min(serving) if serving else None

    def down_s(self, since: datetime, until: datetime) -> float:
        """Seconds of [since, until] the control plane was down: its latest gaps, and the one it is in."""
        gaps = self.plane_gaps if self.plane_down_since is None else [*self.plane_gaps, (self.plane_down_since, until)]
        return sum(max(0.0, (min(b, until) - max(a, since)).total_seconds()) for a, b in gaps)

    def idle_s(self, replica_id: str, now: datetime) -> float | None:
        """How long nobody has asked for a replica at ``now`` (``idle_since`` on), less the time the control
        plane was down in between, when nobody could; None when no router knows."""
        since = self.idle_since(replica_id)
        if since is None:
            return None
        return max(0.0, (now - since).total_seconds() - self.down_s(since, now))


def booking_mib(spec: m.ModelSpec, card_mib: int) -> int:
    """MiB one replica of ``spec`` books on each GPU it uses, on a card of ``card_mib``: the one rule.

    Exclusive: the whole card. vLLM: ``gpu_memory_utilization`` x the card, because that is what
    vLLM takes (it sizes its KV cache to fill it, whatever the context). llama.cpp: what its plan
    charges (``gib_per_gpu``: weights + KV at its context and slots + compute buffers), which is all
    it allocates. A spec with no figure (declared before plans carried one) books the whole card.
    """
    if spec.exclusive:
        return card_mib
    if spec.engine == "vllm":
        need = math.ceil(spec.gpu_memory_utilization * card_mib) if spec.gpu_memory_utilization > 0 else card_mib
    else:
        need = math.ceil(spec.gib_per_gpu * 1024) if spec.gib_per_gpu > 0 else card_mib
    return max(1, min(card_mib, need))


def shares_card(spec: m.ModelSpec, card_mib: int) -> bool:
    """Whether a replica of ``spec`` leaves room beside it on such a card."""
    return booking_mib(spec, card_mib) < card_mib


T = TypeVar("T")


def by_fabric(items: Iterable[T], fabric_of: Callable[[T], str]) -> dict[str, list[T]]:
    """``items`` (nodes, or what stands for them) grouped by the fabric each is attached to.

    A replica never spans fabrics: a multi-node replica is placed, and planned, inside one
    of these groups; a single-node one is not constrained by them. The planner and the
    scheduler both group by this one function, in the order the items come.
    """
    out: dict[str, list[T]] = {}
    for item in items:
        out.setdefault(fabric_of(item), []).append(item)
    return out


def requests_moved(event: m.IdleMapPublished, before: RouterView | None) -> list[str]:
    """The replicas whose newest request an idle map reports first or later than its router's last map.

    The one diff of an idle map, computed once per map by ``fold_batch`` and handed to
    everything that reads it: the fold, DuckDB's idle history, what-if. The newest request
    per replica only grows, so an entry the router reported last tick is unchanged: in C,
    only what moved (a few a tick) comes out.
    """
    lr = event.last_request
    if before is None:
        return list(lr)
    return list(compress(lr, map(ne, lr.values(), map(before.last_request.get, lr))))


def apply(state: FleetState, event: m.Event, seq: int = 0, moved: list[str] | None = None) -> FleetState:
    """Fold one event into the state and return it; ``seq`` is where its stream stores it.

    ``moved``: an idle map's ``requests_moved``, when the caller has it already.
    """
    at = event.at
    if state.as_of is None or at > state.as_of:
        state.as_of = at
    match event:  # the frequent kinds first: each case is one isinstance check
        case m.GpuHealthChanged():
            node = state.nodes.get(event.node)
            changed = node.gpus.get(event.gpu_index) if node else None
            if node is not None and changed is not None:
                if changed.healthy and not event.healthy:
                    record_fault(state, changed.uuid, event.at)
                changed.healthy, changed.reasons, changed.since = event.healthy, event.reasons, event.at
                node.updated_at = event.at
        case m.ReplicaStateChanged():
            replica = state.replicas.get(event.replica_id)
            # Only a node the replica was placed on speaks for it (``speaks_for``).
            if replica is not None and event.state != "stopped" and event.node in replica.nodes:
                if len(replica.nodes) > 1:
                    _part_changed(replica, event)
                else:
                    # The same state again (a healthy engine's memory read anew) is no change of state.
                    replica.state_at = event.at if event.state != replica.state else replica.state_at
                    replica.state = event.state
                    replica.endpoint, replica.detail, replica.restarts = event.endpoint, event.detail, event.restarts
                if event.node == replica.nodes[0]:
                    replica.endpoint_seq = seq  # only the head (or only node) sets the endpoint
                if event.observed_kv_tokens > 0:
                    replica.observed_kv_tokens = event.observed_kv_tokens
                if 0 < event.observed_memory_mib <= OBSERVED_MIB_MAX:
                    replica.observed_memory_mib[event.node] = event.observed_memory_mib
        case m.ReplicaPlaced():
            state.replicas[event.replica_id] = ReplicaView(
                replica_id=event.replica_id,
                model=event.model,
                nodes=event.nodes,
                gpus=event.gpus,
                fabric=event.fabric,
                spec=event.spec,
                placed_at=event.at,
                state_at=event.at,
                placed_seq=seq,
            )
            model = state.models.get(event.model)
            if model is not None:
                model.unplaceable_reason = model.unplaceable_at = None
        case m.ReplicaStopped():
            if (gone := state.replicas.pop(event.replica_id, None)) is not None:
                for ref in gone.gpus:
                    state.released[ref.uuid] = event.at
        case m.ReplicaOverBooked():
            if (replica := state.replicas.get(event.replica_id)) is not None and event.node in replica.nodes:
                replica.overbooked = event  # only a node it was placed on speaks for it
        case m.IdleMapPublished():
            before = state.routers.get(event.router)
            # The event's own dicts: nothing mutates them (a copy each was ~3 µs a map).
            state.routers[event.router] = RouterView(
                boot_id=event.boot_id, tick=event.tick, at=event.at, serving_since=event.serving_since,
                last_request=event.last_request,
            )
            lr = event.last_request
            for rid in moved if moved is not None else requests_moved(event, before):
                t = lr[rid]
                known = state.last_request.get(rid)
                if known is None or t > known:
                    state.last_request[rid] = t
            if before is not None and before.boot_id == event.boot_id:
                _forget_gone(state, event, before)
            if event.callers:
                _count_key_usage(state, event)
            for rid, use in event.cache_use.items():  # only replicas answered this tick: a few
                replica = state.replicas.get(rid)
                if replica is not None:
                    replica.prompt_tokens += use.prompt_tokens
                    replica.cached_tokens += min(use.cached_tokens, use.prompt_tokens)
        case m.NodeInventoryReported():
            old = state.nodes.get(event.node)
            state.nodes[event.node] = NodeView(
                name=event.node,
                fabric=event.fabric,
                fabric_source=event.fabric_source,
                boot_id=event.boot_id,
                gpus={
                    g.index: GpuView(
                        node=event.node,
                        index=g.index,
                        uuid=g.uuid,
                        name=g.name,
                        gpu_class=g.gpu_class,
                        memory_mib=g.memory_mib,
                        healthy=g.healthy,
                        reasons=g.reasons,
                        since=event.at,
                    )
                    for g in event.gpus
                },
                # An inventory is the agent speaking: the node is not lost.
                lost=False,
                simulated=event.simulated,
                updated_at=event.at,
                vllm_version=event.vllm_version,
                llamacpp_version=event.llamacpp_version,
            )
            if old is not None:
                for idx, gpu in state.nodes[event.node].gpus.items():
                    prev = old.gpus.get(idx)
                    if prev is not None and prev.uuid == gpu.uuid and (prev.healthy, prev.reasons) == (gpu.healthy, gpu.reasons):
                        gpu.since = prev.since
        case m.NodeLost():
            node = state.nodes.get(event.node)
            if node is not None:
                node.lost, node.lost_at, node.updated_at = True, event.at, event.at
        case m.NodeReturned():
            node = state.nodes.get(event.node)
            if node is not None:
                node.lost, node.lost_at, node.updated_at = False, None, event.at
        case m.NodeRetired():
            if (retired := state.nodes.pop(event.node, None)) is not None:  # its next inventory, if ever, brings it back
                for g in retired.gpus.values():
                    state.released.pop(g.uuid, None)
            state.files.pop(event.node, None)
        case m.NodeFilesReported() | m.DownloadProgressed() | m.DownloadFinished() | m.FilesEvicted():
            fold_files(state.files, state.downloads, state.downloaded, event)
        case m.ModelPinned():
            (state.pinned.add if event.pinned else state.pinned.discard)(event.name)
        case m.ModelDeclared(spec=spec):
            state.models[spec.name] = ModelView(spec=spec, replicas_wanted=spec.replicas, declared_at=event.at)
        case m.ModelScaled() | m.ModelAutoscaled():
            model = state.models.get(event.name)
            if model is not None:
                model.replicas_wanted = event.replicas
                model.replicas_by = "operator" if type(event) is m.ModelScaled else "autoscaler"
                # A new count is a new question: whether it fits is the scheduler's to say again.
                model.unplaceable_reason = model.unplaceable_at = None
        case m.ModelRemoved():
            state.models.pop(event.name, None)
        case m.AdapterLoaded():
            state.loaded.setdefault(event.replica_id, {})[event.adapter] = event.at
        case m.AdapterUnloaded():
            held = state.loaded.get(event.replica_id)
            if held is not None:
                held.pop(event.adapter, None)
                if not held:
                    del state.loaded[event.replica_id]
        case m.ControlPlaneStopped():
            if state.plane_down_since is None:
                state.plane_down_since = event.at
        case m.ControlPlaneStarted():
            if (gap := plane_gap(state.plane_down_since, state.plane_started_at, event)) is not None:
                state.plane_gaps.append(gap)
                del state.plane_gaps[:-PLANE_GAPS_KEPT]
            state.plane_boot, state.plane_started_at, state.plane_down_since = event.boot_id, event.at, None
        case m.NodeCordoned():
            state.cordoned[event.node] = event
        case m.NodeUncordoned():
            state.cordoned.pop(event.node, None)
            state.uncordoned_at[event.node] = event.at
        case m.AdapterDeclared(spec=adapter):
            state.adapters[adapter.name] = adapter
        case m.AdapterRemoved():
            state.adapters.pop(event.name, None)
        case m.KeyDeclared():
            state.keys[event.name] = event
        case m.KeyRevoked():
            state.keys.pop(event.name, None)
        case m.ModelUnplaceable():
            model = state.models.get(event.name)
            if model is not None:
                model.unplaceable_reason, model.unplaceable_at = event.reason, event.at
        case _:
            pass  # heartbeats and anything newer than this fold: not part of history
    return state


def model_state(*, healthy: bool, placed: bool, replicas_wanted: int, replicas_by: str, unplaceable: str | None,
                failing: bool = False) -> str:
    """A declared model's cold-start state: serving, starting, failing, stopped, unplaceable or parked.

    Serving: a replica is healthy. Starting: replicas are placed, none healthy
    yet. Failing: placed, none healthy, and its engines failed to start (the
    agent restarts them, the scheduler re-places them; a router holds a request
    for it as for a starting one, since the next start may hold). Stopped: the
    operator scaled it to 0, and only a scale brings it back.
    Unplaceable: none placed and the scheduler said why. Parked: none placed,
    stopped for idleness or scaled to zero by the autoscaler: a request wakes it.
    The fold and the router's pool both ask this, each from its own view.
    """
    if healthy:
        return "serving"
    if placed:
        return "failing" if failing else "starting"
    if replicas_wanted == 0 and replicas_by != "autoscaler":
        return "stopped"
    return "unplaceable" if unplaceable else "parked"


# How bad a part's state is: the replica is as bad as its worst part.
_PART_RANK = {"failed": 0, "unhealthy": 1, "starting": 2, "placed": 3, "healthy": 4}


def part_state(nodes: tuple[str, ...], parts: dict[str, str]) -> str:
    """A multi-node replica's state from its parts': healthy only when every node's part is."""
    if any(n not in parts for n in nodes):
        worst = min((parts[n] for n in nodes if n in parts), key=_PART_RANK.__getitem__, default="placed")
        return worst if _PART_RANK[worst] < _PART_RANK["starting"] else "starting"
    return min((parts[n] for n in nodes), key=_PART_RANK.__getitem__)


def _part_changed(replica: ReplicaView, event: m.ReplicaStateChanged) -> None:
    replica.parts[event.node] = event.state
    if event.node == replica.nodes[0]:
        replica.endpoint, replica.head_address = event.endpoint, event.head_address
    replica.detail = f"{event.node}: {event.detail}" if event.detail else replica.detail
    replica.restarts = max(replica.restarts, event.restarts)
    whole = part_state(replica.nodes, replica.parts)
    replica.state, replica.state_at = whole, event.at if whole != replica.state else replica.state_at


def speaks_for(nodes: tuple[str, ...], event: m.ReplicaStateChanged) -> str | None:
    """Why a replica placed on ``nodes`` does not take this state report, or None when it does.

    An agent may publish state for any replica id on its own node's subject; only
    a node the replica was placed on (any of them, for a multi-node replica) is
    believed, or one agent could point a model's traffic at an endpoint of its
    choosing. The fold and the router's pool both ask this.
    """
    if event.node in nodes:
        return None
    return (f"state {event.state!r} for replica {event.replica_id!r} from node {event.node!r}, "
            f"which it was not placed on (placed on {', '.join(nodes) or 'no node'})")


def refusal(state: FleetState, subject: str, event: m.Event, *, subject_checked: bool = False) -> str | None:
    """Why a reader records an event as refused instead of folding it, or None.

    Its subject names another node than its payload (``subjects.disagrees``), or
    it is a state report for a replica from a node it was not placed on. Asked
    before ``apply`` on the state so far, so a live projector and a replay refuse
    the same events (each stream's order alone decides).
    """
    why = None if subject_checked else subjects.disagrees(subject, event)
    if why is None and type(event) is m.ReplicaStateChanged:
        replica = state.replicas.get(event.replica_id)
        if replica is not None:
            why = speaks_for(replica.nodes, event)
    return why


FAULT_DAYS = 7  # how long the fold remembers a GPU's fault
FAULTS_KEPT = 64  # the most remembered per GPU: a flapping card's older ones go first


def record_fault(state: FleetState, uuid: str, at: datetime) -> None:
    """Note that GPU ``uuid`` went unhealthy at ``at``; every GPU's faults older than FAULT_DAYS go.

    The sweep over every GPU that ever faulted runs only when some fault is old enough to go: the
    oldest one the map holds is kept beside it (not a field, never encoded; checked against the map
    it was taken of, so a decoded or replaced map is measured afresh). A history with a fault every
    minute or so (the replay benchmark's) made every fault a pass over every GPU's list: 150 µs an
    event of the fleet stream, most of the projector's fold.
    """
    faults = state.faults
    times = faults.setdefault(uuid, [])
    times.append(at)
    if len(times) > FAULTS_KEPT:
        del times[: len(times) - FAULTS_KEPT]  # the oldest known can only be older than what is left: safe
    cutoff = at - timedelta(days=FAULT_DAYS)
    known = state.__dict__.get("_oldest_fault")
    if known is not None and known[0] is faults:
        oldest = min(known[1], at)
    else:
        oldest = min(map(min, faults.values()))
    if oldest <= cutoff:
        for key in list(faults):
            kept = [t for t in faults[key] if t > cutoff]
            if not kept:
                del faults[key]
            elif len(kept) < len(faults[key]):
                faults[key] = kept
        oldest = min(map(min, faults.values())) if faults else at
    state.__dict__["_oldest_fault"] = (faults, oldest)


def plane_gap(down_since: datetime | None, started_at: datetime | None,
              event: m.ControlPlaneStarted) -> tuple[datetime, datetime] | None:
    """The gap a ``ControlPlaneStarted`` closes: from the recorded stop (``down_since``), else from when the
    one before was last seen (a kill -9), never before the start before it; None when nothing was down."""
    begin = down_since if down_since is not None else event.last_seen
    if begin is None:
        return None
    if started_at is not None:
        begin = max(begin, started_at)
    return (begin, event.at) if begin < event.at else None


PLANE_GAPS_KEPT = 32  # an idle time older than this many restarts counts the older gaps in

KEY_USAGE_DAYS = 8  # today and the seven before: the dashboard's "7 days"
ASKED_DAYS = 30  # how long the fold remembers when a model or adapter was last asked for


def _count_key_usage(state: FleetState, event: m.IdleMapPublished) -> None:
    """What each key asked over a router's tick, added to its day (UTC); days past the window are dropped."""
    day = event.at.astimezone(UTC).strftime("%Y-%m-%d")
    oldest = (event.at.astimezone(UTC) - timedelta(days=KEY_USAGE_DAYS - 1)).strftime("%Y-%m-%d")
    asked = state.asked
    for key, per in event.callers.items():
        days = state.key_usage.setdefault(key, {})
        row = days.get(day)
        if row is None:
            row = days[day] = [0, 0]
            cutoff = event.at - timedelta(days=ASKED_DAYS)
            for name in [n for n, t in asked.items() if t < cutoff]:  # once a key's day: names go in time
                del asked[name]
        for model, use in per.items():
            row[0] += use.requests
            row[1] += use.prompt_tokens + use.completion_tokens
            if use.requests:
                asked[model] = event.at
        for old in [d for d in days if d < oldest]:
            del days[old]


def _forget_gone(state: FleetState, event: m.IdleMapPublished, before: RouterView) -> None:
    """Drop the newest request of replicas that just left the last router map listing them.

    A router drops a stopped replica from its map, so without this the state
    would keep one entry per replica the fleet ever ran (150k after the replay
    benchmark's week), and every checkpoint would carry them all. Only a router
    that kept its boot is evidence: one that restarted and knows nothing yet
    says nothing about what stopped. The usage stream alone decides, so the
    result does not depend on how the streams interleave. A replica comes
    back only with a newer request or serving time, so idleness is never
    overstated; one that left every map while unhealthy is unknown until then.
    """
    if before.last_request.keys() == event.last_request.keys() and before.serving_since.keys() == event.serving_since.keys():
        return  # the same replicas as last tick (most ticks): nothing left
    gone = (before.last_request.keys() | before.serving_since.keys()) - (
        event.last_request.keys() | event.serving_since.keys())
    others = [r for name, r in state.routers.items() if name != event.router]
    for rid in gone:
        if not any(rid in r.last_request or rid in r.serving_since for r in others):
            state.last_request.pop(rid, None)
            state.loaded.pop(rid, None)  # the adapters loaded into it went with it


# Event times come from the publisher's clock; the stream's own (the server's, when it
# stored the message) bounds them. An event dated more than MAX_AHEAD after it was
# stored, or more than MAX_BEHIND before, is folded at the time it was stored and
# counted: one host with a wrong clock (or one forged date, 9999-12-31) must not set
# the fleet's clock for good. Late delivery (an outbox after an outage, an import of
# old history) is normal, hence the wide window behind.
MAX_AHEAD = timedelta(minutes=5)
MAX_BEHIND = timedelta(days=3650)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def stored_at(ts_ns: int) -> datetime:
    """A stream's store time (ns since the epoch) as an aware datetime, to the microsecond."""
    return _EPOCH + timedelta(microseconds=ts_ns // 1000)


def clamp_times(events: list[Any], stored_ns: list[int]) -> int:
    """Replace, in ``events``, each one dated outside its store time's window by a copy at that time.

    ``stored_ns[i]`` is when the stream stored ``events[i]``. Returns how many were
    replaced. Whether an event is clamped depends on it alone, never on the batch
    it came in, so every reader (projector, replay, scheduler, planner) folds the
    same times.
    """
    if not events:
        return 0
    return _clamp(events, list(map(_AT, events)), stored_ns, 0, len(events))


_AT = attrgetter("at")


def _clamp(events: list[Any], ats: list[datetime], stored_ns: list[int], i: int, j: int) -> int:
    # A run whose latest time is within the window of its earliest store time (and whose earliest
    # within that of its latest) holds no event outside its own window: a few C-level passes
    # decide it. Otherwise halve it; a short run is judged event by event.
    part, stored = ats[i:j], stored_ns[i:j]
    if max(part) <= stored_at(min(stored)) + MAX_AHEAD and min(part) >= stored_at(max(stored)) - MAX_BEHIND:
        return 0
    if j - i > 16:
        k = (i + j) // 2
        return _clamp(events, ats, stored_ns, i, k) + _clamp(events, ats, stored_ns, k, j)
    clamped = 0
    for x in range(i, j):
        t = stored_at(stored_ns[x])
        if not t - MAX_BEHIND <= ats[x] <= t + MAX_AHEAD:
            events[x] = msgspec.structs.replace(events[x], at=t)
            clamped += 1
    return clamped


def fold(events: Iterable[m.Event], state: FleetState | None = None) -> FleetState:
    """Fold many events; a fresh state when none is given."""
    state = FleetState() if state is None else state
    for event in events:
        apply(state, event)
    return state
