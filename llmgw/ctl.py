"""What ``llmgw ctl`` does, as a library: ask, fold, decide, publish. The CLI only parses and formats.

Every function here opens its own short-lived bus connection (``reconnect=False``:
a command that cannot reach NATS says so at once) and closes it. Heavy imports
(the bus, DuckDB, the planner) happen inside the functions, so a command pays
only for what it uses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.config import Settings
from llmgw.errors import LlmgwError, PlanError
from llmgw.fleet.fold import FleetState
from llmgw.fleet.status import IdleRow, idle_rows, nobody_asked

if TYPE_CHECKING:
    from llmgw.bus import Bus

CATCH_UP_S = 5.0  # how long a projector behind the streams gets to catch up before ``idle`` replays
STATUS_WAIT_S = 3.0  # … and before ``status`` says it lags

Notice = Callable[[str], None]  # a line for the operator (the CLI prints it to stderr)
Progress = Callable[[int, int], None] | None


async def _connect(settings: Settings, name: str) -> Bus:
    from llmgw.bus import Bus

    return await Bus.connect(settings, name, reconnect=False)


async def replay_state(bus: Bus, streams: tuple[str, ...] = subjects.HISTORY_STREAMS, *,
                       use_snapshots: bool = True, notice: Notice | None = None) -> FleetState:
    """The fold of every stored event of ``streams`` up to now: what ``ctl`` commands decide on."""
    from llmgw.fleet.replay import replay

    return (await replay(bus, streams=streams, use_snapshots=use_snapshots, warn=notice)).state


async def stream_heads(bus: Bus) -> dict[str, int]:
    """The last sequence of every history stream now: what an answer asked for now must include."""
    return {s: await bus.stream_last_seq(s) for s in subjects.HISTORY_STREAMS}


# --- status ------------------------------------------------------------------------------------------


async def fetch_status(settings: Settings, threshold_s: float, *, replay: bool, at: datetime | None = None,
                       at_seq: tuple[str, int] | None = None, progress: Progress = None, replicas: bool = False,
                       model: str = "", use_snapshots: bool = True, notice: Notice | None = None) -> m.StatusReport:
    """The report from the projector's status service, once it has folded what is stored now; or, with
    ``replay``, ``at`` or ``at_seq``, by folding the streams here (in memory, no DuckDB), from the
    newest fold snapshot before that point unless ``use_snapshots`` is off.

    ``replicas`` adds every replica, ``model`` that model in full (``model_detail``).
    """
    bus = await _connect(settings, "llmgw-ctl-status")
    try:
        if not replay:
            req = m.StatusRequest(idle_threshold_s=threshold_s, wait_for=await stream_heads(bus), wait_s=STATUS_WAIT_S,
                                  replicas=replicas, model=model)
            data = await bus.request(subjects.STATUS, m.encode(req), timeout=STATUS_WAIT_S + settings.request_timeout_s,
                                     service="projector (status service; run `llmgw project` or use --replay)")
            return m.STATUS_REPORT_DECODER.decode(data)
        return await _replayed_report(bus, threshold_s, at=at, at_seq=at_seq, progress=progress, replicas=replicas,
                                      model=model, use_snapshots=use_snapshots, notice=notice)
    finally:
        await bus.close()


async def _replayed_report(bus: Bus, threshold_s: float, *, at: datetime | None = None,
                           at_seq: tuple[str, int] | None = None, progress: Progress = None, replicas: bool = False,
                           model: str = "", use_snapshots: bool = True,
                           notice: Notice | None = None) -> m.StatusReport:
    """The report the status service gives, from the streams folded here: the same fold, the same history."""
    from llmgw.fleet.replay import replay as fold_streams
    from llmgw.fleet.status import report

    c = await fold_streams(bus, at=at, at_seq=at_seq, progress=progress, use_snapshots=use_snapshots, warn=notice)
    if at is not None and not c.cursor.positions:  # nothing stored by then: before the history, or none yet
        first = await first_stored(bus)
        if first is not None and at < first:
            from llmgw.errors import ProjectionError

            raise ProjectionError(
                f"--at {at:%Y-%m-%d %H:%M:%S} UTC is before the first event stored ({first:%Y-%m-%d %H:%M:%S} UTC), "
                "when the fleet had no history; give a time from then to now, or leave --at out for the fleet now")
    return report(c.state, at, threshold_s, c.cursor, history=c.history, replicas=replicas, model=model)


async def first_stored(bus: Bus, streams: tuple[str, ...] = subjects.HISTORY_STREAMS) -> datetime | None:
    """When the server stored the oldest message the history streams still hold; None when they hold none."""
    from llmgw.fleet.fold import stored_at

    firsts: list[int] = []
    for stream in streams:
        last = await bus.stream_last_seq(stream)
        if not last:
            continue
        reader = bus.reader(stream, 1, batch=1, stop_at=last, purpose="first stored")
        async with contextlib.aclosing(reader.batches()) as batches:  # type: ignore[type-var]
            async for msgs in batches:
                if msgs:
                    firsts.append(msgs[0].ts_ns)
                    break
    return stored_at(min(firsts)) if firsts else None


# --- models ------------------------------------------------------------------------------------------


async def _model_report(settings: Settings, *, replay: bool, model: str = "",
                        notice: Notice = lambda _: None) -> m.StatusReport:
    """The status report for the model commands: from the projector, or replayed here when asked or when none runs."""
    from llmgw.errors import NoServiceError

    if not replay:
        try:
            return await fetch_status(settings, 1800.0, replay=False, model=model)
        except NoServiceError:
            notice("no projector is running: replaying the streams here (slower on a long history)")
    return await fetch_status(settings, 1800.0, replay=True, model=model)


def _older_projector(report: m.StatusReport) -> None:
    if report.models and not report.model_list:
        raise LlmgwError("the projector that answered is an older version that does not list models; "
                         "restart it (`llmgw project`, or `llmgw up`), or use --replay")


async def list_models(settings: Settings, *, replay: bool = False,
                      notice: Notice = lambda _: None) -> tuple[m.ModelSummary, ...]:
    """Every declared model: state, replicas healthy/placed/wanted, split, idle, GPU-hours today, KV figures."""
    report = await _model_report(settings, replay=replay, notice=notice)
    _older_projector(report)
    return report.model_list


async def show_model(settings: Settings, name: str, *, replay: bool = False,
                     notice: Notice = lambda _: None) -> m.ModelDetail:
    """One declared model in full: spec and plan figures, replicas, latest control events."""
    report = await _model_report(settings, replay=replay, model=name, notice=notice)
    _older_projector(report)
    if report.model_detail is None:
        names = ", ".join(s.name for s in report.model_list) or "none"
        raise LlmgwError(f"no model named {name!r} is declared (declared: {names}); "
                         "see `llmgw ctl model list`, or deploy it with `llmgw ctl model deploy NAME MODEL --from-plan`")
    return report.model_detail


# --- idle --------------------------------------------------------------------------------------------


async def fetch_idle(settings: Settings, older_than_s: float, *, replay: bool = False, now: datetime | None = None,
                     notice: Notice = lambda _: None, use_snapshots: bool = True,
                     model: str | None = None) -> tuple[list[IdleRow], datetime, str]:
    """Every replica idle ``older_than_s`` or more and every unknown one, the clock used, and the source.

    From the projector's status service when one answers with every event
    stored when we asked folded in (a projector that is behind would see old
    idle maps and overstate idleness); otherwise, or with ``replay``, by
    folding the streams here, which takes longer the longer the history.
    With ``model``, only that model's replicas; a model not declared is an error.
    """
    now = now or m.utcnow()
    bus = await _connect(settings, "llmgw-ctl-idle")
    try:
        found = None if replay else await _idle_from_projector(bus, older_than_s, now, notice)
        if found is None:
            state = await replay_state(bus, use_snapshots=use_snapshots, notice=notice)
    finally:
        await bus.close()
    if found is not None:
        (rows, declared), source = found, "projector"
    else:
        rows = [r for r in idle_rows(state, now) if nobody_asked(r, older_than_s)]
        declared, source = sorted(state.models), "replay"
    if model is not None:
        # An older projector lists no models: then only its rows can say a name exists.
        if declared and model not in declared and all(r.model != model for r in rows):
            raise LlmgwError(f"no model named {model!r} is declared (declared: {', '.join(declared)}); "
                             "see `llmgw ctl model list`")
        rows = [r for r in rows if r.model == model]
    return rows, now, source


async def _idle_from_projector(bus: Bus, older_than_s: float, now: datetime,
                               notice: Notice) -> tuple[list[IdleRow], list[str]] | None:
    """The projector's idle rows and declared models once it has folded what is stored now; None: no projector, or it lags."""
    from llmgw.errors import NoServiceError, ServiceError

    req = m.StatusRequest(idle_threshold_s=older_than_s, now=now, wait_for=await stream_heads(bus), wait_s=CATCH_UP_S)
    try:
        data = await bus.request(subjects.STATUS, m.encode(req), service="projector (status service)",
                                 timeout=CATCH_UP_S + bus.settings.request_timeout_s)
        report = m.STATUS_REPORT_DECODER.decode(data)
    except NoServiceError:
        notice("no projector is running: replaying the streams here (slower on a long history)")
        return None
    except (ServiceError, msgspec.DecodeError) as e:  # behind, no answer in time, an error, another version
        notice(f"the projector could not answer ({e}): replaying the streams here")
        return None
    # The report's order is idle_rows' order: most GPU-time idle first, unknown last.
    return ([IdleRow(r.replica_id, r.model, r.nodes, r.gpus, r.state, r.idle_s if r.idle_s >= 0 else None,
                     r.idle_since) for r in report.idle], sorted(s.name for s in report.model_list))


async def stop_idle(settings: Settings, rows: list[IdleRow]) -> list[int]:
    """Publish ``ReplicaStopped`` reason ``idle`` for each row; the stream sequences."""
    bus = await _connect(settings, "llmgw-ctl-idle")
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


# --- history, for ``llmgw replay`` ---------------------------------------------------------------------


class Entry(NamedTuple):
    """One stored message, decoded when it could be."""

    at: datetime
    stream: str
    seq: int
    subject: str
    stored_at: datetime
    event: m.Event | None
    raw: bytes
    error: str


def involves_node(event: m.Event, node: str) -> bool:
    if getattr(event, "node", None) == node:
        return True
    if node in getattr(event, "nodes", ()):
        return True
    return any(g.node == node for g in getattr(event, "gpus", ()) if isinstance(g, m.GpuRef))


def involves_model(event: m.Event, model: str) -> bool:
    if isinstance(event, m.ModelDeclared):
        return event.spec.name == model
    if isinstance(event, m.IdleMapPublished):
        return False
    return model in (getattr(event, "model", None), getattr(event, "name", None))


async def read_entries(settings: Settings, streams: tuple[str, ...], subject: str | None,
                       since: datetime | None, until: datetime | None, node: str | None,
                       model: str | None, progress: Progress = None) -> list[Entry]:
    """Every stored message that passes the filters, raw and decoded where it could be, in event-time order."""
    bus = await _connect(settings, "llmgw-replay")
    out: list[Entry] = []
    try:
        stops = {s: await bus.stream_last_seq(s) for s in streams}
        total = sum(stops.values())
        done = 0
        for stream, last in stops.items():
            if last == 0:
                continue
            reader = bus.reader(stream, 1, stop_at=last, filter_subjects=[subject] if subject else [])
            async with contextlib.aclosing(reader.batches()) as batches:  # type: ignore[type-var]
                async for msgs in batches:
                    for x in msgs:
                        out.extend(_entry(stream, x.seq, x.subject, x.data, x.ts_ns, since, until, node, model))
                    done += len(msgs)
                    if progress is not None:
                        progress(done, total)
    finally:
        await bus.close()
    out.sort(key=lambda e: (e.at, e.stream, e.seq))
    return out


def _entry(stream: str, seq: int, subject: str, data: bytes, ts_ns: int, since: datetime | None,
           until: datetime | None, node: str | None, model: str | None) -> Iterator[Entry]:
    stored = datetime.fromtimestamp(ts_ns / 1e9, UTC)
    try:
        event: m.Event | None = subjects.DECODERS[stream].decode(data)
        error = ""
    except m.DECODE_ERRORS as e:
        event, error = None, str(e) or type(e).__name__
    at = event.at if event is not None else stored
    if (since and at < since) or (until and at > until):
        return
    if event is None:
        if not node and not model:
            yield Entry(at, stream, seq, subject, stored, None, data, error)
        return
    if node and not involves_node(event, node):
        return
    if model and not involves_model(event, model):
        return
    yield Entry(at, stream, seq, subject, stored, event, data, "")


# --- plans -------------------------------------------------------------------------------------------


def local_model(model: str, models_dir: str | None, params: int | None) -> m.ModelInfo | None:
    """The model read here when it is a directory or in the models directory; else the planner reads it."""
    from llmgw import modelinfo

    md = modelinfo.models_dir(models_dir)
    if modelinfo.local_dir(model, md) is not None:  # a name too long for a path is no folder, not a crash
        return modelinfo.load(model, models_dir_=md, params=params)
    return None


def plan_locally(model: str, fleet_path: Path, request: m.PlanRequest, models_dir: str | None) -> m.PlanReply:
    """What-if: plan against a fleet file, without NATS."""
    from llmgw import fleetfile, modelinfo, planner
    from llmgw.fleet.fold import fold

    fleet = fleetfile.load(fleet_path)
    reports = fleetfile.inventories(fleet, m.utcnow())
    state = fold(reports)
    info = modelinfo.load(model, models_dir_=models_dir, params=request.params)
    return planner.plan(info, state, request, engine_versions={r.node: r.vllm_version for r in reports})


async def plan_remotely(settings: Settings, request: m.PlanRequest) -> m.PlanReply:
    """Ask a running planner over NATS."""
    from llmgw.errors import ConnectError
    from llmgw.planner_service import ask

    try:
        bus = await _connect(settings, "llmgw-ctl-plan")
    except ConnectError as e:
        raise ConnectError(f"{e}; or plan without NATS against a fleet file: --fleet FILE") from e
    try:
        return await ask(bus, request)
    finally:
        await bus.close()


async def plan(settings: Settings, model: str, request: m.PlanRequest, *, fleet: Path | None = None,
               models_dir: str | None = None) -> m.PlanReply:
    """A plan against ``fleet`` (a file, no NATS) or from the running planner; a model found here is read here."""
    if fleet is not None:
        return plan_locally(model, fleet, request, models_dir)
    info = local_model(model, models_dir, request.params)
    return await plan_remotely(settings, msgspec.structs.replace(request, info=info))


def choose(reply: m.PlanReply, *, candidate: int | None, gpu_class: str | None, engine: str | None,
           pp: int | None = None) -> m.Candidate:
    """The candidate to deploy: the N-th the planner listed, or the best one matching the flags.

    Refuses (PlanError) with the planner's reason when what was asked for does not fit.
    """
    fitting = [c for c in reply.candidates if c.fits]
    if candidate is not None:
        if not 1 <= candidate <= len(fitting):
            listed = f"candidates 1 to {len(fitting)}" if fitting else "no candidate that fits"
            why = f" ({'; '.join(reply.notes)})" if reply.notes else ""
            raise PlanError(f"--candidate {candidate}: the planner lists {listed} for {reply.model}{why}; "
                            f"see `llmgw ctl model plan {reply.model}`")
        chosen = fitting[candidate - 1]
    else:
        pool = list(reply.candidates)
        if gpu_class is not None:
            classes = sorted({c.gpu_class for c in reply.candidates})
            pool = [c for c in pool if c.gpu_class == gpu_class]
            if not pool:
                have = ", ".join(classes) if classes else "none with a live healthy GPU"
                raise PlanError(f"no node has {gpu_class} GPUs (classes in the fleet: {have}); choose --gpu-class from those")
        if pp is not None:
            pool = [c for c in pool if c.pp == pp]
        if not pool:
            raise PlanError(f"the planner found no split of {reply.model}: {'; '.join(reply.notes) or 'nothing fits'}")
        fits = [c for c in pool if c.fits]
        if not fits:
            best = pool[0]
            raise PlanError(f"{reply.model} at {best.precision}, tp={best.tp}, pp={best.pp} on {best.gpu_class} does not fit: "
                            f"{best.reason}; see `llmgw ctl model plan {reply.model} --all` for what does")
        chosen = fits[0]
    if engine is not None and engine != chosen.engine:
        raise PlanError(f"precision {chosen.precision} is served by {chosen.engine}, not {engine}; "
                        f"{'GGUF precisions (q8_0, q6_K, q5_K_M, q4_K_M)' if engine == 'llama.cpp' else 'bf16, fp16, fp8, awq or gptq'} "
                        f"are served by {engine}: change --precision or drop --engine")
    return chosen


def gguf_file(chosen: m.Candidate, given: str) -> str:
    """``deploy --file``: a file here is recorded by its absolute path, a bare name as it is
    (looked up in the model's directory, or downloaded from its repository, by the agent)."""
    if chosen.engine != "llama.cpp":
        raise PlanError(f"--file names a GGUF for llama.cpp, but the chosen candidate runs {chosen.precision} on "
                        f"{chosen.engine}; add --precision q8_0 (or another GGUF precision), or drop --file")
    path = Path(given).expanduser()
    if path.is_file():
        return str(path.resolve())
    if path.name != given:
        raise PlanError(f"--file {given}: no such file here; give a path to the GGUF, or a bare file name that "
                        f"{chosen.source} holds")
    if not given.endswith(".gguf"):
        raise PlanError(f"--file {given}: llama.cpp serves a .gguf file; name one, e.g. {chosen.file}")
    return given


# --- the control stream ------------------------------------------------------------------------------


async def publish_control(settings: Settings, event: m.Event, *, must_exist: str | None = None) -> int:
    """Publish one control event; with ``must_exist``, only if that model is declared now. Its sequence."""
    bus = await _connect(settings, "llmgw-ctl-model")
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
DERIVED = ("gib_per_gpu", "kv_tokens", "engine_version", "gpu_memory_utilization")


def _shown(value: object) -> str:
    if isinstance(value, tuple):
        return " ".join(map(str, value)) or "(none)"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1_000:
        return f"{value:,}"
    return "(none)" if value is None else str(value)


def spec_changes(old: m.ModelSpec, new: m.ModelSpec) -> tuple[list[str], list[str]]:
    """What differs, as ``field old → new``: (the operator's inputs, the plan's derived figures)."""
    inputs: list[str] = []
    derived: list[str] = []
    for f in msgspec.structs.fields(m.ModelSpec):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if a != b:
            (derived if f.name in DERIVED else inputs).append(f"{f.name} {_shown(a)} → {_shown(b)}")
    return inputs, derived


@dataclass(frozen=True)
class Declaration:
    spec: m.ModelSpec  # what is declared now
    seq: int | None  # the ModelDeclared published; None: unchanged, nothing published
    changes: tuple[str, ...] = ()  # the operator's inputs that changed (empty for a new model)
    moved: tuple[str, ...] = ()  # the plan's figures that moved and were kept as declared (or replanned)
    new: bool = False
    rolls: bool = False  # what its replicas run with changed: the scheduler replaces them, one by one


async def declare(settings: Settings, spec: m.ModelSpec, *, replan: bool = False) -> Declaration:
    """Declare ``spec`` unless it is what is declared already: apply the same declaration twice, get one.

    A declared model whose inputs are unchanged keeps its declaration (and its running replicas),
    even when the plan's derived figures moved since; ``replan`` publishes them too.
    """
    bus = await _connect(settings, "llmgw-ctl-model")
    try:
        state = await replay_state(bus, (subjects.STREAM_CONTROL,))
        view = state.models.get(spec.name)
        if view is None:
            return Declaration(spec, (await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec))).seq, new=True)
        inputs, derived = spec_changes(view.spec, spec)
        if not inputs and not (replan and derived):
            return Declaration(view.spec, None, moved=tuple(derived))
        # An input changed: the new plan's figures are the ones for it.
        from llmgw.scheduler import same_run

        seq = (await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec))).seq
        return Declaration(spec, seq, tuple(inputs), tuple(derived), rolls=not same_run(view.spec, spec))
    finally:
        await bus.close()


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
    bus = await _connect(settings, "llmgw-ctl-key")
    try:
        return dict(sorted((await replay_state(bus, (subjects.STREAM_CONTROL,))).keys.items()))
    finally:
        await bus.close()


async def publish_key(settings: Settings, event: m.KeyDeclared | m.KeyRevoked, *, must_exist: bool) -> int:
    """Publish a key's declaration or revocation as admin (keys are the admin role's alone); its sequence."""
    bus = await _connect(settings.with_local_login("admin"), "llmgw-ctl-key")
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


# --- nodes ------------------------------------------------------------------------------------------------


async def retire_node(settings: Settings, node: str, reason: str, *, force: bool = False) -> int:
    """Publish NodeRetired for a node that is gone (admin's); its fleet sequence.

    Refused for a node no agent ever reported, and (unless ``force``) for one that is not lost:
    a live node's next inventory would only bring it back. Its last heartbeat is purged too, so
    that no liveness monitor started later judges it lost again.
    """
    bus = await _connect(settings.with_local_login("admin"), "llmgw-ctl-node")
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


# --- the agents and llmgw up ---------------------------------------------------------------------------


async def inject_fault(settings: Settings, cmd: m.InjectFault) -> m.FaultInjected:
    """Ask the agent of ``cmd.node`` to inject (simulated) or clear a GPU fault; its answer."""
    bus = await _connect(settings, "llmgw-agent-fault")
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
    bus = await _connect(settings, "llmgw-up")
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
