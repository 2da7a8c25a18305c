"""Subject and stream names: the only module that writes a subject literal.

Every subject an agent publishes carries its node name as a token, so that
nats.conf can let an agent speak only for its own node.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from llmgw import messages as m

PREFIX = "llmgw"

STREAM_FLEET = "LLMGW_FLEET"
STREAM_HEARTBEAT = "LLMGW_HEARTBEAT"
STREAM_USAGE = "LLMGW_USAGE"
STREAM_CONTROL = "LLMGW_CONTROL"
# Engines' API keys (``EngineKeyIssued``): agents write, only routers and admin read.
STREAM_ENGINE_KEYS = "LLMGW_ENGINE_KEYS"
# The projector's fold snapshots: a JetStream object store (its stream is OBJ_LLMGW_SNAPSHOTS).
SNAPSHOT_BUCKET = "LLMGW_SNAPSHOTS"

# Request/reply services (not stored).
PLAN = f"{PREFIX}.plan"
STATUS = f"{PREFIX}.status"
PLANNER_QUEUE = "llmgw-planners"

# A KV bucket that holds the scheduler's lease (one decider at a time).
SCHEDULER_LEASE_BUCKET = "LLMGW_SCHEDULER"

_SAFE = re.compile(r"[A-Za-z0-9_-]")
_ALL_SAFE = re.compile(r"[A-Za-z0-9_-]+").fullmatch

GIB = 1024**3
DAY = 86_400.0


@functools.lru_cache(maxsize=65536)  # node and replica names repeat: folds check every event's subject
def token(name: str) -> str:
    """A name as one subject token: [A-Za-z0-9_-] kept, anything else ``~hh``.

    Node names may hold dots (FQDNs) and model names slashes; a dot would split
    the token and ``*``/``>`` would be wildcards. The encoding is reversible.
    """
    if not name:
        raise ValueError("an empty name cannot be a subject token")
    if _ALL_SAFE(name):
        return name
    return "".join(c if _SAFE.match(c) else "".join(f"~{b:02x}" for b in c.encode()) for c in name)


def untoken(tok: str) -> str:
    """The name a token was made from."""
    out = bytearray()
    i = 0
    while i < len(tok):
        if tok[i] == "~":
            out.append(int(tok[i + 1 : i + 3], 16))
            i += 3
        else:
            out.extend(tok[i].encode())
            i += 1
    return out.decode()


# --- builders -------------------------------------------------------------------


def fleet(node: str, kind: str) -> str:
    """``llmgw.fleet.<node>.<kind>``: inventory, health, lost, returned; files, download, evicted (what its disk holds)."""
    return f"{PREFIX}.fleet.{token(node)}.{kind}"


def heartbeat(node: str) -> str:
    return f"{PREFIX}.heartbeat.{token(node)}"


def agent_fault(node: str) -> str:
    """``llmgw.agent.<node>.fault``: a simulated agent's fault injection (request/reply, not stored)."""
    return f"{PREFIX}.agent.{token(node)}.fault"


def usage_idle(router: str) -> str:
    return f"{PREFIX}.usage.{token(router)}.idle"


USAGE_IDLE_ALL = f"{PREFIX}.usage.*.idle"  # every router's idle maps (what a router's quotas follow)


def usage_day(router: str) -> str:
    """``llmgw.usage.<router>.day``: what a router's maps of the day said each key used (``KeyDayTotals``)."""
    return f"{PREFIX}.usage.{token(router)}.day"


USAGE_DAY_ALL = f"{PREFIX}.usage.*.day"


def usage_adapter(router: str) -> str:
    """``llmgw.usage.<router>.adapter``: adapters a router loaded into (or unloaded from) replicas."""
    return f"{PREFIX}.usage.{token(router)}.adapter"


def usage_wanted(router: str) -> str:
    """``llmgw.usage.<router>.wanted``: a router holds requests for a model with no healthy replica (and
    says when it sent them on: ``WakeAnswered``)."""
    return f"{PREFIX}.usage.{token(router)}.wanted"


def usage_speaks_for(subject: str, router: str) -> bool:
    """Whether a usage subject's router token is ``router``: a subject is a claim the payload must match."""
    parts = subject.split(".")
    return len(parts) == 4 and parts[1] == "usage" and bool(router) and parts[2] == token(router)


def inbox_prefix(user: str) -> str:
    """``_INBOX.<user>``: where a process logged in as ``user`` gets its replies, and nats.conf lets only it listen."""
    return f"_INBOX.{token(user)}"


# Events that name the node they speak for, and their kind of fleet subject.
_FLEET_KINDS: dict[type, str] = {m.NodeInventoryReported: "inventory", m.GpuHealthChanged: "health",
                                 m.NodeLost: "lost", m.NodeReturned: "returned", m.NodeRetired: "retired",
                                 m.NodeFilesReported: "files", m.DownloadProgressed: "download",
                                 m.DownloadFinished: "download", m.FilesEvicted: "evicted"}


def disagrees(subject: str, event: m.Event) -> str | None:
    """Why a stored event does not say what its subject claims, or None when it agrees.

    nats.conf lets each role publish only on its own subjects (an agent on its own
    node's, the CLI on model declarations, the scheduler on placements); the payload
    could still say something else: an agent's ``ReplicaPlaced`` on its own state
    subject, another node's inventory on its own. An event is believed only on exactly
    the subject ``subject_for`` gives it, or nobody may believe it (the fold's readers
    record and count it, like an undecodable one).
    """
    kind = type(event)
    try:
        if kind is m.ReplicaStateChanged:  # the most frequent with a node: built here, not matched
            expected = replica(event.replica_id, "state", event.node)  # type: ignore[attr-defined]
        elif kind is m.IdleMapPublished or kind is m.MapCallers:  # the most frequent of all
            expected = usage_idle(event.router)  # type: ignore[attr-defined]
        else:
            expected = subject_for(event)
    except (ValueError, TypeError):
        expected = ""  # an empty name: no subject could carry it; a kind with no subject: none does
    if subject == expected:
        return None
    if kind in _FLEET_KINDS or kind is m.HeartbeatSent or kind is m.ReplicaStateChanged or kind is m.ReplicaOverBooked:
        rid = f" for replica {event.replica_id!r}" if kind in (m.ReplicaStateChanged, m.ReplicaOverBooked) else ""  # type: ignore[attr-defined]
        return (f"{kind.__name__} names node {event.node!r}{rid} but was published on {subject!r}: "  # type: ignore[attr-defined]
                "the subject's node and the payload's must agree")
    return (f"{kind.__name__} belongs on {expected or 'no subject'!r} but was published on {subject!r}: "
            "an event is believed only on its own subject")


def model(name: str, kind: str) -> str:
    """``llmgw.control.model.<name>.<kind>``: declared, scaled, removed, unplaceable."""
    return f"{PREFIX}.control.model.{token(name)}.{kind}"


def adapter(name: str, kind: str) -> str:
    """``llmgw.control.adapter.<name>.<kind>``: declared, removed (``ctl adapter``)."""
    return f"{PREFIX}.control.adapter.{token(name)}.{kind}"


def key(name: str, kind: str) -> str:
    """``llmgw.control.key.<name>.<kind>``: declared, revoked (the admin role's only)."""
    return f"{PREFIX}.control.key.{token(name)}.{kind}"


def replica(replica_id: str, kind: str, node: str | None = None) -> str:
    """``llmgw.control.replica.<id>.<kind>``; state reports end with the agent's node."""
    base = f"{PREFIX}.control.replica.{token(replica_id)}.{kind}"
    return f"{base}.{token(node)}" if node is not None else base


def agent_control() -> tuple[str, ...]:
    """What an agent reads of the control stream: models declared, removed, pinned and prefetched, and
    placements and stops; the server delivers nothing else (``bus.Follower(filter_subjects=…)``).

    Keys, scaling, unplaceable verdicts, cordons and every node's state reports are the readers'
    (routers, scheduler, projector), not an agent's: at 300 nodes each agent that read them all cost
    the bus 300 copies of every key and state report. The one state an agent needs, a multi-node
    replica's head address, it reads on ``head_states``.
    """
    return tuple(f"{PREFIX}.control.model.*.{kind}" for kind in ("declared", "removed", "pinned", "prefetch")) + \
        tuple(f"{PREFIX}.control.replica.*.{kind}" for kind in ("placed", "stopped"))


def head_states(heads: dict[str, str]) -> tuple[str, ...]:
    """The state subjects of replicas' heads (replica → its head's node): where a worker node learns
    the address its part of a multi-node replica joins."""
    return tuple(replica(rid, "state", node) for rid, node in sorted(heads.items()))


def engine_key(replica_id: str, node: str) -> str:
    """``llmgw.enginekey.<replica>.<node>``: a replica's engine key on that node (``EngineKeyIssued``)."""
    return f"{PREFIX}.enginekey.{token(replica_id)}.{token(node)}"


def control_plane(kind: str) -> str:
    """``llmgw.control.plane.<kind>``: started, stopped (``llmgw up``'s own, as admin)."""
    return f"{PREFIX}.control.plane.{kind}"


def subject_for(event: m.Event) -> str:
    """The subject an event is published on."""
    match event:
        case m.NodeInventoryReported(node=node):
            return fleet(node, "inventory")
        case m.GpuHealthChanged(node=node):
            return fleet(node, "health")
        case m.NodeLost(node=node):
            return fleet(node, "lost")
        case m.NodeReturned(node=node):
            return fleet(node, "returned")
        case m.NodeRetired(node=node):
            return fleet(node, "retired")
        case m.NodeFilesReported(node=node):
            return fleet(node, "files")
        case m.DownloadProgressed(node=node) | m.DownloadFinished(node=node):
            return fleet(node, "download")
        case m.FilesEvicted(node=node):
            return fleet(node, "evicted")
        case m.ModelPrefetchRequested(name=name):
            return model(name, "prefetch")
        case m.ModelPinned(name=name):
            return model(name, "pinned")
        case m.HeartbeatSent(node=node):
            return heartbeat(node)
        case m.EngineKeyIssued(replica_id=replica_id, node=node):
            return engine_key(replica_id, node)
        case m.IdleMapPublished(router=router):
            return usage_idle(router)
        case m.ModelWanted(router=router) | m.WakeAnswered(router=router):
            return usage_wanted(router)
        case m.AdapterLoaded(router=router) | m.AdapterUnloaded(router=router):
            return usage_adapter(router)
        case m.KeyDayTotals(router=router):
            return usage_day(router)
        case m.NodeCordoned(node=node):
            return f"{PREFIX}.control.node.{token(node)}.cordoned"
        case m.ControlPlaneStarted():
            return control_plane("started")
        case m.ControlPlaneStopped():
            return control_plane("stopped")
        case m.NodeUncordoned(node=node):
            return f"{PREFIX}.control.node.{token(node)}.uncordoned"
        case m.AdapterDeclared(spec=spec):
            return adapter(spec.name, "declared")
        case m.AdapterRemoved(name=name):
            return adapter(name, "removed")
        case m.KeyDeclared(name=name):
            return key(name, "declared")
        case m.KeyRevoked(name=name):
            return key(name, "revoked")
        case m.ModelDeclared(spec=spec):
            return model(spec.name, "declared")
        case m.ModelScaled(name=name):
            return model(name, "scaled")
        case m.ModelAutoscaled(name=name):
            return model(name, "autoscaled")
        case m.ModelRemoved(name=name):
            return model(name, "removed")
        case m.ModelUnplaceable(name=name):
            return model(name, "unplaceable")
        case m.ReplicaPlaced(replica_id=rid):
            return replica(rid, "placed")
        case m.ReplicaStateChanged(replica_id=rid, node=node):
            return replica(rid, "state", node)
        case m.ReplicaStopped(replica_id=rid):
            return replica(rid, "stopped")
        case m.ReplicaOverBooked(replica_id=rid, node=node):
            return replica(rid, "overbooked", node)
    raise TypeError(f"no subject for {type(event).__name__}")


def msg_id(event: m.Event, payload: bytes) -> str:
    """A deterministic ``Nats-Msg-Id``: the same event retried is stored once.

    The id is the event's type and a hash of its bytes, which include ``at``;
    a publisher that must dedupe across processes passes its own key instead.
    """
    digest = hashlib.blake2b(payload, digest_size=16).hexdigest()
    return f"{type(event).__name__}:{digest}"


# --- JetStream's own API: what the bus calls and nats.conf grants -------------------

JS_API_INFO = "$JS.API.INFO"


def js_api(*tokens: str) -> str:
    """``$JS.API.<tokens…>``, e.g. ``js_api("STREAM.INFO", stream)`` or, for nats.conf, ``js_api("STREAM.DELETE", ">")``."""
    return ".".join(("$JS.API", *tokens))


def js_stream(verb: str, stream: str) -> str:
    """CREATE, UPDATE, INFO, DELETE, PURGE, MSG.GET, MSG.DELETE of a stream."""
    return js_api("STREAM", verb, stream)


def js_consumer(verb: str, stream: str, consumer: str = "") -> str:
    """CREATE, DELETE, INFO, MSG.NEXT of a stream's consumer (``*``/``>`` for nats.conf)."""
    return js_api("CONSUMER", verb, stream, *((consumer,) if consumer else ()))


def kv_subjects(bucket: str) -> str:
    return f"$KV.{bucket}.>"


# --- streams ----------------------------------------------------------------------


@dataclass(frozen=True)
class StreamSpec:
    """One JetStream stream as llmgw declares it."""

    name: str
    subjects: tuple[str, ...]
    max_age_s: float  # 0 = keep forever
    max_bytes: int  # -1 = unlimited
    duplicate_window_s: float
    discard_new: bool  # refuse writes when full rather than drop history silently
    max_msgs_per_subject: int = -1
    sync_always: bool = False  # documented production setting; see docs/reliability.md


# Fleet and control are the source of truth for status and placement: they are
# never aged out (a lost inventory would make a node vanish from replay) and
# refuse new writes when full, loudly, instead of dropping old facts.
STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec(
        name=STREAM_FLEET,
        subjects=(f"{PREFIX}.fleet.>",),
        max_age_s=0,
        max_bytes=8 * GIB,
        duplicate_window_s=20 * 60,
        discard_new=True,
        sync_always=True,
    ),
    StreamSpec(
        name=STREAM_CONTROL,
        subjects=(f"{PREFIX}.control.>",),
        max_age_s=0,
        max_bytes=2 * GIB,
        duplicate_window_s=20 * 60,
        discard_new=True,
        sync_always=True,
    ),
    StreamSpec(
        name=STREAM_USAGE,
        subjects=(f"{PREFIX}.usage.>",),
        max_age_s=30 * DAY,
        max_bytes=32 * GIB,
        duplicate_window_s=20 * 60,
        discard_new=False,
    ),
    StreamSpec(
        name=STREAM_HEARTBEAT,
        subjects=(f"{PREFIX}.heartbeat.*",),
        max_age_s=1 * DAY,
        max_bytes=256 * 1024**2,
        duplicate_window_s=60,
        discard_new=False,
        max_msgs_per_subject=1,
    ),
    # The latest key of each replica's engine on each node; a key outlives nothing but its engine, so
    # old ones are only dropped when the stream is full (each a few hundred bytes).
    StreamSpec(
        name=STREAM_ENGINE_KEYS,
        subjects=(f"{PREFIX}.enginekey.*.*",),
        max_age_s=0,
        max_bytes=256 * 1024**2,
        duplicate_window_s=20 * 60,
        discard_new=False,
        max_msgs_per_subject=1,
    ),
)

# The streams that status and the projections replay, in fold order.
HISTORY_STREAMS: tuple[str, ...] = (STREAM_FLEET, STREAM_CONTROL, STREAM_USAGE)
# What each history stream may hold: an event of another stream's kind there is undecodable.
DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    STREAM_FLEET: m.FLEET_DECODER, STREAM_CONTROL: m.CONTROL_DECODER, STREAM_USAGE: m.USAGE_DECODER,
}

STREAM_BY_NAME = {s.name: s for s in STREAMS}


def stream_for_subject(subject: str) -> str:
    """The stream that stores a subject."""
    parts = subject.split(".")
    if len(parts) >= 2 and parts[0] == PREFIX:
        kind = {"fleet": STREAM_FLEET, "control": STREAM_CONTROL, "usage": STREAM_USAGE,
                "heartbeat": STREAM_HEARTBEAT, "enginekey": STREAM_ENGINE_KEYS}.get(parts[1])
        if kind:
            return kind
    raise ValueError(f"{subject!r} is not an llmgw stream subject")
