"""What ``ctl`` publishes: declarations, stops, keys, retired nodes, faults, and ``up``'s first model."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.config import Settings
from llmgw.ctl.ask import connect, replay_state
from llmgw.ctl.plan import plan_locally
from llmgw.errors import LlmgwError

if TYPE_CHECKING:  # the fold and the engine's argv only where a declaration is checked: ``ctl`` binds this module at once
    from llmgw.fleet.state import FleetState
    from llmgw.fleet.status import IdleRow




async def stop_idle(settings: Settings, rows: list[IdleRow]) -> list[int]:
    """Publish ``ReplicaStopped`` reason ``idle`` for each row; the stream sequences."""
    bus = await connect(settings, "llmgw-ctl-idle")
    seqs = []
    try:
        for r in rows:
            # reason "idle" as before codes: ctl what-if tells an operator's stop from the scheduler's by it.
            event = m.ReplicaStopped(at=m.utcnow(), replica_id=r.replica_id, model=r.model, code="idle", reason="idle")
            # The scheduler stops a replica under the same id: one stop, whoever was first.
            seqs.append((await bus.publish(event, msg_id=f"ReplicaStopped:{r.replica_id}")).seq)
    finally:
        await bus.close()
    return seqs





async def publish_control(settings: Settings, event: m.Event, *, must_exist: str | None = None) -> int:
    """Publish one control event; with ``must_exist``, only if that model is declared now. Its sequence."""
    bus = await connect(settings, "llmgw-ctl-model")
    try:
        if must_exist is not None:
            state = await replay_state(bus, (subjects.STREAM_CONTROL,))
            if must_exist not in state.models:
                names = ", ".join(sorted(state.models)) or "none"
                raise LlmgwError(f"no model named {must_exist!r} is declared (declared: {names}); "
                                 f"deploy it first with `llmgw ctl model deploy {must_exist} MODEL --from-plan`")
        return (await bus.publish(event)).seq
    finally:
        await bus.close()


# --- declarations -----------------------------------------------------------------------------------------

# What the planner derives rather than the operator asks: a re-plan moves them (the observed-memory
# calibration, another engine version on the fleet) while nothing the operator said changed. A
# declaration keeps the figures it was first declared with until an input changes (or --replan).
# One the operator gave (deploy --gpu-memory-utilization) is an input of that declaration: ``asked``.
DERIVED = ("gib_per_gpu", "kv_tokens", "kv_gib_per_gpu", "engine_version", "gpu_memory_utilization")


def _shown(value: object) -> str:
    if isinstance(value, tuple):
        return " ".join(map(str, value)) or "(none)"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1_000:
        return f"{value:,}"
    return "(none)" if value is None else str(value)


def spec_changes(old: m.ModelSpec, new: m.ModelSpec,
                 asked: Collection[str] = ()) -> tuple[list[str], list[str]]:
    """What differs, as ``field old → new``: (the operator's inputs, the plan's derived figures); a DERIVED
    field in ``asked`` is one the operator gave this time, an input."""
    inputs: list[str] = []
    derived: list[str] = []
    for f in msgspec.structs.fields(m.ModelSpec):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if a != b:
            # Exclusive moves replicas: whole GPUs alone, or a booking beside others.
            why = f" ({'whole GPUs, alone' if b else 'shares GPUs by memory'})" if f.name == "exclusive" else ""
            (derived if f.name in DERIVED and f.name not in asked else inputs).append(
                f"{f.name} {_shown(a)} → {_shown(b)}{why}")
    return inputs, derived


@dataclass(frozen=True)
class Declaration:
    spec: m.ModelSpec  # what is declared now
    seq: int | None  # the ModelDeclared published; None: unchanged, nothing published
    changes: tuple[str, ...] = ()  # the operator's inputs that changed (empty for a new model)
    moved: tuple[str, ...] = ()  # the plan's figures that moved and were kept as declared (or replanned)
    new: bool = False
    rolls: bool = False  # what its replicas run with changed: the scheduler replaces them, one by one
    kept_figures: bool = False  # only knobs changed: ``moved`` were kept as declared, not published


async def declare(settings: Settings, spec: m.ModelSpec, *, replan: bool = False,
                  asked: Collection[str] = ()) -> Declaration:
    """Declare ``spec`` unless it is what is declared already: apply the same declaration twice, get one.

    A declared model whose inputs are unchanged keeps its declaration (and its running replicas),
    even when the plan's derived figures moved since; ``replan`` publishes them too. ``asked``: the
    DERIVED fields the operator gave this time (``gpu_memory_utilization``), compared as inputs.
    """
    return (await declare_many(settings, [(spec, tuple(asked))], replan=replan))[0]


async def declare_many(settings: Settings, specs: Sequence[tuple[m.ModelSpec, Collection[str]]], *,
                       replan: bool = False) -> list[Declaration]:
    """``declare`` each (spec, asked), decided on one fold of what is declared and published in one
    pipelined batch (``apply`` of 1,000 models: one replay and one round of acks, not 1,000 of each).

    Every spec is checked before anything is published: one that cannot be declared publishes nothing.
    """
    bus = await connect(settings, "llmgw-ctl-model")
    try:
        state = await replay_state(bus, (subjects.STREAM_CONTROL, subjects.STREAM_FLEET))
        decided = [_decide(state, spec, tuple(asked), replan) for spec, asked in specs]
        events = [m.ModelDeclared(at=m.utcnow(), spec=d.spec) for d in decided if d.seq is not None]
        seqs = iter(ack.seq for ack in await bus.publish_many(events))
        return [d if d.seq is None else dataclasses.replace(d, seq=next(seqs)) for d in decided]
    finally:
        await bus.close()


def _decide(state: FleetState, spec: m.ModelSpec, asked: tuple[str, ...], replan: bool) -> Declaration:
    """What declaring ``spec`` on ``state`` publishes: a Declaration whose ``seq`` is 0 where a
    ModelDeclared of its ``spec`` is to be published, None where nothing is."""
    if (missing := missing_file(spec, state)) is not None:
        raise LlmgwError(missing)
    view = state.models.get(spec.name)
    if view is None:
        return Declaration(spec, 0, new=True)
    spec = keep_adapters(view.spec, spec, state.adapters)
    inputs, derived = spec_changes(view.spec, spec, asked)
    if not inputs and not (replan and derived):
        return Declaration(view.spec, None, moved=tuple(derived))
    from llmgw.scheduler.placement import same_run

    kept = msgspec.structs.replace(spec, **{f: getattr(view.spec, f) for f in DERIVED if f not in asked})
    if not replan and same_run(view.spec, kept):
        # Only what the scheduler and routers read changed (replicas, autoscaling, TTL, routing): the
        # figures stay as first declared, or a re-plan's would roll the replicas for nothing.
        return Declaration(kept, 0, tuple(inputs), tuple(derived), kept_figures=True)
    # An input the engine runs with changed: the new plan's figures are the ones for it.
    return Declaration(spec, 0, tuple(inputs), tuple(derived), rolls=not same_run(view.spec, spec))


def missing_file(spec: m.ModelSpec, state: FleetState) -> str | None:
    """Why a llama.cpp spec's GGUF cannot be there, where that is knowable; None otherwise.

    A bare file name of a model directory is read from that directory: one that exists here without
    it is refused. Otherwise the nodes' files reports decide: where every node that holds the source
    reports its files and none the GGUF, no node has it (a repository's may still be downloaded).
    """
    from llmgw.engine.argv import is_repo_id

    if spec.engine != "llama.cpp" or not spec.file or Path(spec.file).is_absolute():
        return None
    name = Path(spec.file).name
    source = Path(spec.source).expanduser()
    if (source.is_absolute() or not is_repo_id(spec.source)) and source.is_dir():
        if (source / spec.file).is_file():
            return None
        there = sorted(p.name for p in source.glob("*.gguf"))[:8]
        return (f"--file {spec.file}: no such file in {source} (GGUF files there: {', '.join(there) or 'none'}); "
                "give one of those, or a path to the GGUF")
    if is_repo_id(spec.source):
        return None  # an agent downloads what no node holds
    nodes = [n for n, nf in state.files.items() if spec.source in nf.sources]
    if nodes and not any(name == Path(f.path).name for n in nodes for h in state.files[n].sources[spec.source]
                         for f in h.files):
        return (f"--file {spec.file}: no node holds it: {spec.source} on {', '.join(sorted(nodes)[:4])} has no such "
                "file; give a GGUF the model's directory holds")
    return None


def keep_adapters(old: m.ModelSpec, new: m.ModelSpec, declared: dict[str, m.AdapterSpec]) -> m.ModelSpec:
    """``new`` with the adapters ``old`` attaches (``ctl adapter`` manages them, not ``deploy``), and
    their memory in its booking: a re-deploy of a llama.cpp base keeps its adapters attached."""
    if new.adapters or not old.adapters or new.engine != "llama.cpp":
        return new
    extra = sum(declared[a.name].size_bytes for a in old.adapters if a.name in declared) / (1 << 30) / max(1, new.tp)
    return msgspec.structs.replace(new, adapters=old.adapters, gib_per_gpu=round(new.gib_per_gpu + extra, 6))


# --- keys -------------------------------------------------------------------------------------------------


def new_key_secret() -> tuple[str, str, str, str]:
    """A fresh key: (secret to print once, key id, salt, salted digest), from the OS's randomness."""
    import secrets

    key_id, salt = secrets.token_hex(8), secrets.token_hex(16)
    secret = f"{m.KEY_PREFIX}{key_id}-{secrets.token_urlsafe(32)}"
    return secret, key_id, salt, key_digest(salt, secret)


def key_digest(salt: str, secret: str) -> str:
    """sha256(salt || secret), hex: what the stream holds instead of the secret."""
    import hashlib

    return hashlib.sha256(bytes.fromhex(salt) + secret.encode()).hexdigest()


async def keys(settings: Settings) -> dict[str, m.KeyDeclared]:
    """The live keys, folded from the control stream here."""
    bus = await connect(settings, "llmgw-ctl-key")
    try:
        return dict(sorted((await replay_state(bus, (subjects.STREAM_CONTROL,))).keys.items()))
    finally:
        await bus.close()


async def publish_key(settings: Settings, event: m.KeyDeclared | m.KeyRevoked, *, must_exist: bool) -> int:
    """Publish a key's declaration or revocation as admin (keys are the admin role's alone); its sequence."""
    bus = await connect(settings.with_local_login("admin"), "llmgw-ctl-key")
    try:
        known = (await replay_state(bus, (subjects.STREAM_CONTROL,))).keys
        if must_exist and event.name not in known:
            names = ", ".join(sorted(known)) or "none"
            raise LlmgwError(f"no key named {event.name!r} (keys: {names}); create it with `llmgw ctl key create "
                             f"{event.name}`")
        if not must_exist and event.name in known:
            raise LlmgwError(f"a key named {event.name!r} exists; change it with `llmgw ctl key update "
                             f"{event.name} …`, or revoke it first")
        return (await bus.publish(event)).seq
    finally:
        await bus.close()


async def publish_keys(settings: Settings, events: Sequence[m.KeyDeclared]) -> list[int]:
    """Publish many new keys as admin in one pipelined batch (``ctl key import``); their sequences.

    Decided on one fold: a name that is declared already publishes nothing at all.
    """
    bus = await connect(settings.with_local_login("admin"), "llmgw-ctl-key")
    try:
        known = (await replay_state(bus, (subjects.STREAM_CONTROL,))).keys
        taken = [e.name for e in events if e.name in known]
        if taken:
            shown = ", ".join(taken[:5]) + (f" and {len(taken) - 5} more" if len(taken) > 5 else "")
            raise LlmgwError(f"{len(taken)} key name{'s exist' if len(taken) != 1 else ' exists'} already ({shown}); "
                             "nothing was imported: drop them from the file, or `llmgw ctl key revoke` them first")
        return [ack.seq for ack in await bus.publish_many(events)]
    finally:
        await bus.close()


# --- nodes ------------------------------------------------------------------------------------------------


async def retire_node(settings: Settings, node: str, reason: str, *, force: bool = False) -> int:
    """Publish NodeRetired for a node that is gone (admin's); its fleet sequence.

    Refused for a node no agent ever reported, and (unless ``force``) for one that is not lost:
    a live node's next inventory would only bring it back. Its last heartbeat is purged too, so
    that no liveness monitor started later judges it lost again.
    """
    bus = await connect(settings.with_local_login("admin"), "llmgw-ctl-node")
    try:
        state = await replay_state(bus, (subjects.STREAM_FLEET,))
        view = state.nodes.get(node)
        if view is None:
            names = ", ".join(sorted(state.nodes)) or "none"
            raise LlmgwError(f"no node named {node!r} is in the fleet (nodes: {names}); see `llmgw ctl status`")
        if not view.lost and not force:
            raise LlmgwError(f"node {node} is not lost: its agent still reports, and its next inventory would bring it "
                             "back; stop its agent and wait until `llmgw ctl status` shows it lost, or pass --force")
        seq = (await bus.publish(m.NodeRetired(at=m.utcnow(), node=node, reason=reason))).seq
        await bus.purge_subject(subjects.STREAM_HEARTBEAT, subjects.heartbeat(node))
        return seq
    finally:
        await bus.close()


async def cordon_node(settings: Settings, node: str, reason: str, *, drain: bool = False,
                      uncordon: bool = False) -> tuple[int, list[str]]:
    """Publish NodeCordoned (or NodeUncordoned) for a node in the fleet: its sequence, and the replicas on it."""
    bus = await connect(settings, "llmgw-ctl-node")
    try:
        state = await replay_state(bus, (subjects.STREAM_FLEET, subjects.STREAM_CONTROL))
        if node not in state.nodes:
            names = ", ".join(sorted(state.nodes)) or "none"
            raise LlmgwError(f"no node named {node!r} is in the fleet (nodes: {names}); see `llmgw ctl status`")
        if uncordon and node not in state.cordoned:
            raise LlmgwError(f"node {node} is not cordoned; nothing to do")
        on = sorted(r.replica_id for r in state.replicas.values() if node in r.nodes)
        event: m.Event = (m.NodeUncordoned(at=m.utcnow(), node=node) if uncordon else
                          m.NodeCordoned(at=m.utcnow(), node=node, reason=reason, drain=drain))
        return (await bus.publish(event)).seq, on
    finally:
        await bus.close()


# --- the agents and llmgw up ---------------------------------------------------------------------------


async def inject_fault(settings: Settings, cmd: m.InjectFault) -> m.FaultInjected:
    """Ask the agent of ``cmd.node`` to inject (simulated) or clear a GPU fault; its answer."""
    bus = await connect(settings, "llmgw-agent-fault")
    try:
        data = await bus.request(subjects.agent_fault(cmd.node), m.encode(cmd), timeout=15,
                                 service=f"agent of {cmd.node} (llmgw agent …)")
    finally:
        await bus.close()
    return msgspec.json.decode(data, type=m.FaultInjected)


async def prepare_up(settings: Settings, fleet_path: Path | None, models_dir: str | None, *,
                     name: str, model: str) -> str:
    """Declare the streams; with a fleet file, declare the example model ``name`` once, if the fleet has room.
    A line saying what was done (empty when nothing was asked)."""
    bus = await connect(settings, "llmgw-up")
    try:
        await bus.ensure_streams()
        if fleet_path is None:
            return ""
        last = await bus.stream_last_seq(subjects.STREAM_CONTROL)
        if last:
            async for batch in bus.reader(subjects.STREAM_CONTROL, 1, stop_at=last).batches():
                if any(r.subject == subjects.model(name, "declared") for r in batch):
                    return f"{name} was declared before; not declaring it again"
        try:
            reply = plan_locally(model, fleet_path, m.PlanRequest(model=model, context=8192), models_dir)
        except LlmgwError as e:
            return f"no example model declared ({e})"
        fitting = [c for c in reply.candidates if c.fits]
        if not fitting:
            return f"no example model declared: {model} does not fit this fleet"
        spec = fitting[0].spec(name)
        await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec), msg_id=f"up:example:{name}")
        return f"declared {name}: {model} {spec.precision} on {spec.tp} × {spec.gpu_class}, context {spec.context:,}"
    finally:
        await bus.close()
