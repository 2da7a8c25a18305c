"""Model files on nodes, for ``ctl model prefetch|pin|unpin|files``: ask agents to fetch, pin, and say where files are."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from llmgw import messages as m
from llmgw.config import Settings
from llmgw.ctl.ask import connect, replay_state
from llmgw.errors import LlmgwError
from llmgw.fleet.files import expected_bytes, holders, where_files_are
from llmgw.fleet.state import FleetState


def _model(state: FleetState, name: str) -> m.ModelSpec:
    model = state.models.get(name)
    if model is None:
        names = ", ".join(sorted(state.models)) or "none"
        raise LlmgwError(f"no model named {name!r} is declared (declared: {names}); "
                         f"deploy it first with `llmgw ctl model deploy {name} MODEL --from-plan`")
    return model.spec


@dataclass(frozen=True)
class Prefetched:
    seq: int
    nodes: tuple[str, ...]  # the nodes asked (every node for --all)
    holding: tuple[str, ...]  # of them, those that hold the files complete already (they fetch nothing)


async def prefetch(settings: Settings, name: str, nodes: tuple[str, ...] = (), *, all_nodes: bool = False,
                   revision: str = "") -> Prefetched:
    """Ask agents to fetch a declared model's files: these nodes, every node (``all_nodes``), or by
    default every node with GPUs of the model's class (where it could be placed)."""
    if nodes and all_nodes:
        raise LlmgwError("name nodes with --nodes or ask every node with --all, not both")
    bus = await connect(settings, "llmgw-ctl-files")
    try:
        state = await replay_state(bus)
        spec = _model(state, name)
        unknown = [n for n in nodes if n not in state.nodes]
        if unknown:
            known = ", ".join(sorted(state.nodes)) or "none reported yet"
            raise LlmgwError(f"no node named {', '.join(unknown)} has reported (nodes: {known})")
        if all_nodes:
            asked = tuple(sorted(state.nodes))
        elif nodes:
            asked = tuple(dict.fromkeys(nodes))
        else:
            asked = tuple(sorted(n.name for n in state.nodes.values()
                                 if any(g.gpu_class == spec.gpu_class for g in n.gpus.values())))
            if not asked:
                raise LlmgwError(f"no node has {spec.gpu_class} GPUs, where {name} is placed; name nodes with "
                                 "--nodes or ask every node with --all")
        event = m.ModelPrefetchRequested(at=m.utcnow(), name=name, nodes=() if all_nodes else asked, revision=revision)
        seq = (await bus.publish(event)).seq
        held = holders(state.files, spec)
        return Prefetched(seq=seq, nodes=asked, holding=tuple(n for n in asked if n in held))
    finally:
        await bus.close()


async def pin(settings: Settings, name: str, pinned: bool = True) -> int:
    """Pin a declared model's files on every node that holds them (no eviction takes them), or unpin; the sequence."""
    bus = await connect(settings, "llmgw-ctl-files")
    try:
        state = await replay_state(bus)
        if pinned:
            _model(state, name)
        elif name not in state.pinned:
            raise LlmgwError(f"{name} is not pinned (pinned: {', '.join(sorted(state.pinned)) or 'none'})")
        return (await bus.publish(m.ModelPinned(at=m.utcnow(), name=name, pinned=pinned))).seq
    finally:
        await bus.close()


@dataclass(frozen=True)
class Fetching:
    node: str
    done: int
    total: int
    rate: float
    at: datetime


@dataclass(frozen=True)
class ModelFiles:
    """Where one declared model's files are, and what is being fetched of them."""

    name: str
    source: str
    file: str
    size: int  # bytes, as a node that holds them reports (0: none does)
    nodes: tuple[str, ...]
    pinned: bool
    fetching: tuple[Fetching, ...] = field(default_factory=tuple)
    failed: tuple[tuple[str, str], ...] = ()  # (node, reason) of the last download that did not verify


def model_files(state: FleetState, name: str | None = None) -> list[ModelFiles]:
    """Every declared model (or the one named): on which nodes its files are complete, and downloads."""
    if name is not None:
        _model(state, name)
    out = []
    for model in sorted(state.models):
        if name is not None and model != name:
            continue
        spec = state.models[model].spec
        fetching = tuple(Fetching(node=node, done=d.done, total=d.total, rate=d.rate, at=d.at)
                         for node, on in sorted(state.downloads.items()) for src, d in on.items()
                         if src == spec.source and d.model == model)
        failed = tuple((node, d.reason) for node, on in sorted(state.downloaded.items())
                       for src, d in on.items() if src == spec.source and d.model == model and not d.ok)
        out.append(ModelFiles(name=model, source=spec.source, file=spec.file or "", size=expected_bytes(state.files, spec),
                              nodes=tuple(sorted(holders(state.files, spec))), pinned=model in state.pinned,
                              fetching=fetching, failed=failed))
    return out


async def files(settings: Settings, name: str | None = None) -> list[ModelFiles]:
    """``model_files`` over the stored history, folded here."""
    bus = await connect(settings, "llmgw-ctl-files")
    try:
        return model_files(await replay_state(bus), name)
    finally:
        await bus.close()


async def plan_files(settings: Settings, reply: m.PlanReply) -> list[str]:
    """For a plan from the running control plane: on how many nodes each candidate's files are, one
    line per distinct source and file (a fleet file knows no disks, so a plan against one has none)."""
    from llmgw import subjects

    bus = await connect(settings, "llmgw-ctl-files")
    try:
        state = await replay_state(bus, (subjects.STREAM_FLEET,))
    finally:
        await bus.close()
    if not state.files:
        return []  # no agent keeps files (simulated fleets): nothing to say
    out: dict[tuple[str, str], str] = {}
    for c in reply.candidates:
        if not c.source or (c.source, c.file or "") in out:
            continue
        probe = m.ModelSpec(name="plan", source=c.source, precision=c.precision, engine=c.engine,
                            gpu_class=c.gpu_class, context=1, file=c.file)
        what = f"{c.source} {c.file}" if c.file else f"{c.source} (checkpoint)"
        out[(c.source, c.file or "")] = f"files: {what} {where_files_are(state.files, probe)}"
    return list(out.values())
