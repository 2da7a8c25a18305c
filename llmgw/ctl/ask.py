"""What ``ctl`` asks: status, models, idle replicas and the stored history, from the projector or folded here."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.config import Settings
from llmgw.errors import ConnectError, LlmgwError

if TYPE_CHECKING:
    from llmgw.bus import Bus, OneShot
    from llmgw.fleet.state import FleetState
    from llmgw.fleet.status import IdleRow

CATCH_UP_S = 5.0  # how long a projector behind the streams gets to catch up before ``idle`` replays
STATUS_WAIT_S = 3.0  # … and before ``status`` says it lags

Notice = Callable[[str], None]  # a line for the operator (the CLI prints it to stderr)
Progress = Callable[[int, int], None] | None



async def connect(settings: Settings, name: str) -> Bus:
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


def ask_status(settings: Settings, threshold_s: float, *, replicas: bool = False, model: str = "") -> m.StatusReport:
    """The report from the projector's status service, once it has folded what is stored now.

    One blocking connection (``OneShot``: no event loop, no nats-py), the question the
    read commands ask most; a ``ws://`` URL asks over ``Bus`` instead.
    """
    from llmgw.bus import OneShot, speaks

    if not speaks(settings):
        import asyncio

        return asyncio.run(fetch_status(settings, threshold_s, replay=False, replicas=replicas, model=model))
    with OneShot.connect(settings, "llmgw-ctl-status") as shot:
        return _status_from(shot, settings, threshold_s, replicas=replicas, model=model)


def _status_from(shot: OneShot, settings: Settings, threshold_s: float, *, replicas: bool, model: str) -> m.StatusReport:
    heads = {s: shot.stream_last_seq(s) for s in subjects.HISTORY_STREAMS}
    req = m.StatusRequest(idle_threshold_s=threshold_s, wait_for=heads, wait_s=STATUS_WAIT_S, replicas=replicas, model=model)
    data = shot.request(subjects.STATUS, m.encode(req), timeout=STATUS_WAIT_S + settings.request_timeout_s,
                        service="projector (status service; run `llmgw project` or use --replay)")
    return m.STATUS_REPORT_DECODER.decode(data)


async def fetch_status(settings: Settings, threshold_s: float, *, replay: bool, at: datetime | None = None,
                       at_seq: tuple[str, int] | None = None, progress: Progress = None, replicas: bool = False,
                       model: str = "", use_snapshots: bool = True, notice: Notice | None = None) -> m.StatusReport:
    """The report from the projector's status service, once it has folded what is stored now; or, with
    ``replay``, ``at`` or ``at_seq``, by folding the streams here (in memory, no DuckDB), from the
    newest fold snapshot before that point unless ``use_snapshots`` is off.

    ``replicas`` adds every replica, ``model`` that model in full (``model_detail``).
    """
    bus = await connect(settings, "llmgw-ctl-status")
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
    from llmgw.fleet.replay import STATUS_KEEPS
    from llmgw.fleet.replay import replay as fold_streams
    from llmgw.fleet.status import report

    c = await fold_streams(bus, at=at, at_seq=at_seq, progress=progress, use_snapshots=use_snapshots, warn=notice,
                           keep=STATUS_KEEPS)
    if at is not None and not c.cursor.positions:  # nothing stored by then: before the history, or none yet
        first = await first_stored(bus)
        if first is not None and at < first:
            from llmgw.errors import ProjectionError

            raise ProjectionError(
                f"--at {at:%Y-%m-%d %H:%M:%S} UTC is before the first event stored ({first:%Y-%m-%d %H:%M:%S} UTC), "
                "when the fleet had no history; give a time from then to now, or leave --at out for the fleet now")
    later = await next_plane_start(bus, c.cursor.positions.get(subjects.STREAM_CONTROL, 0)) \
        if at is not None or at_seq is not None else None
    return report(c.state, at, threshold_s, c.cursor, history=c.history, replicas=replicas, model=model,
                  next_start=later)


async def next_plane_start(bus: Bus, after: int) -> m.ControlPlaneStarted | None:
    """The first control-plane event the control stream stored after sequence ``after``, when it is a start:
    what a moment in the past learns of a gap nothing recorded while it lasted (a kill -9)."""
    last = await bus.stream_last_seq(subjects.STREAM_CONTROL)
    if last <= after:
        return None
    reader = bus.reader(subjects.STREAM_CONTROL, after + 1, batch=1, stop_at=last, purpose="the next start",
                        filter_subjects=[subjects.control_plane("*")])
    async with contextlib.aclosing(reader.batches()) as batches:  # type: ignore[type-var]
        async for msgs in batches:
            for x in msgs:
                try:
                    event = m.CONTROL_DECODER.decode(x.data)
                except m.DECODE_ERRORS:
                    continue  # recorded and skipped by every fold; the next one may say
                if subjects.disagrees(x.subject, event) is None:
                    return event if isinstance(event, m.ControlPlaneStarted) else None
    return None


async def first_stored(bus: Bus, streams: tuple[str, ...] = subjects.HISTORY_STREAMS) -> datetime | None:
    """When the server stored the oldest message the history streams still hold; None when they hold none."""
    from llmgw.fleet.state import stored_at

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


# --- usage -------------------------------------------------------------------------------------------

LiveUsage = tuple[str, int, int, int, int]  # name, requests today, tokens today, requests 7 days, tokens 7 days


async def live_usage(settings: Settings, by: str) -> tuple[list[LiveUsage], datetime | None]:
    """What the routers' maps said, summed per tenant (the status service's figures) or per key (the
    control and usage streams folded here); and as of when. The fold keeps no figures per model."""
    if by in ("model", "adapter"):
        raise LlmgwError("--live answers --by tenant or --by key (the fold sums requests and tokens per key and "
                         f"day); per {by}, read the projection: leave --live out")
    if by == "tenant":
        report = await fetch_status(settings, 1800.0, replay=False)
        return [(u.tenant, u.requests_today, u.tokens_today, u.requests_7d, u.tokens_7d) for u in report.tenants], \
            report.now
    from llmgw.fleet.status import key_usage

    bus = await connect(settings, "llmgw-ctl-usage")
    try:
        state = await replay_state(bus, (subjects.STREAM_CONTROL, subjects.STREAM_USAGE))
    finally:
        await bus.close()
    return [(k, r, t, r7, t7) for k, _, r, t, r7, t7 in key_usage(state, m.utcnow())], state.as_of


def projector_usage(settings: Settings, by: str, since_days: int,
                    notice: Notice = lambda _: None) -> tuple[m.UsageTable, datetime | None] | None:
    """``ctl usage`` from the running projector's file (what it folded when asked, committed), and the time
    of the newest event folded; None (``notice`` says why) when no projector answers with it: read the file."""
    from llmgw.errors import BusError, NoServiceError, ServiceError

    req = m.StatusRequest(wait_s=STATUS_WAIT_S, usage_by=by, usage_days=since_days)  # type: ignore[arg-type]
    who = "projector (status service)"
    try:
        report = _ask_with_heads(settings, req, who)
    except NoServiceError:
        notice("no projector is running")
        return None
    except (ConnectError, ServiceError, BusError, msgspec.DecodeError) as e:
        notice(f"the projector could not answer ({e})")
        return None
    if report.usage is None:
        notice("the projector that answered keeps no DuckDB file, or is an older version")
        return None
    return report.usage, report.now


def _ask_with_heads(settings: Settings, req: m.StatusRequest, who: str) -> m.StatusReport:
    """The status service's answer to ``req`` once it has folded what is stored now (OneShot, or the Bus for ws://)."""
    from llmgw.bus import OneShot, speaks

    timeout = STATUS_WAIT_S + settings.request_timeout_s
    if not speaks(settings):
        import asyncio

        async def ask() -> bytes:
            bus = await connect(settings, "llmgw-ctl-usage")
            try:
                heads = await stream_heads(bus)
                return await bus.request(subjects.STATUS, m.encode(msgspec.structs.replace(req, wait_for=heads)),
                                         timeout=timeout, service=who)
            finally:
                await bus.close()

        return m.STATUS_REPORT_DECODER.decode(asyncio.run(ask()))
    with OneShot.connect(settings, "llmgw-ctl-usage") as shot:
        heads = {s: shot.stream_last_seq(s) for s in subjects.HISTORY_STREAMS}
        data = shot.request(subjects.STATUS, m.encode(msgspec.structs.replace(req, wait_for=heads)), timeout=timeout,
                            service=who)
    return m.STATUS_REPORT_DECODER.decode(data)


# --- models ------------------------------------------------------------------------------------------


async def _model_report(settings: Settings, *, replay: bool, model: str = "",
                        notice: Notice = lambda _: None) -> m.StatusReport:
    """The status report for the model commands: from the projector, or replayed here when asked or when none runs."""
    from llmgw.errors import NoServiceError

    if not replay:
        try:
            return await fetch_status(settings, 1800.0, replay=False, model=model)
        except NoServiceError:
            notice(NO_PROJECTOR)
    return await fetch_status(settings, 1800.0, replay=True, model=model)


NO_PROJECTOR = "no projector is running: replaying the streams here (slower on a long history)"


def _projector_report(settings: Settings, model: str, notice: Notice) -> m.StatusReport | None:
    """``_model_report`` from the projector alone, over ``OneShot``; None (and the notice) when none runs."""
    from llmgw.errors import NoServiceError

    try:
        return ask_status(settings, 1800.0, model=model)
    except NoServiceError:
        notice(NO_PROJECTOR)
        return None


def _older_projector(report: m.StatusReport) -> None:
    if report.models and not report.model_list:
        raise LlmgwError("the projector that answered is an older version that does not list models; "
                         "restart it (`llmgw project`, or `llmgw up`), or use --replay")


def _detail(report: m.StatusReport, name: str) -> m.ModelDetail:
    _older_projector(report)
    if report.model_detail is None:
        names = ", ".join(s.name for s in report.model_list) or "none"
        raise LlmgwError(f"no model named {name!r} is declared (declared: {names}); "
                         "see `llmgw ctl model list`, or deploy it with `llmgw ctl model deploy NAME MODEL --from-plan`")
    return report.model_detail


async def list_models(settings: Settings, *, replay: bool = False,
                      notice: Notice = lambda _: None) -> tuple[m.ModelSummary, ...]:
    """Every declared model: state, replicas healthy/placed/wanted, split, idle, GPU-hours today, KV figures."""
    report = await _model_report(settings, replay=replay, notice=notice)
    _older_projector(report)
    return report.model_list


def list_models_now(settings: Settings, *, notice: Notice = lambda _: None) -> tuple[m.ModelSummary, ...] | None:
    """``list_models`` from the projector, without an event loop; None when none runs (``notice`` said so): replay."""
    report = _projector_report(settings, "", notice)
    if report is None:
        return None
    _older_projector(report)
    return report.model_list


async def show_model(settings: Settings, name: str, *, replay: bool = False,
                     notice: Notice = lambda _: None) -> m.ModelDetail:
    """One declared model in full: spec and plan figures, replicas, latest control events."""
    return _detail(await _model_report(settings, replay=replay, model=name, notice=notice), name)


def show_model_now(settings: Settings, name: str, *, notice: Notice = lambda _: None) -> m.ModelDetail | None:
    """``show_model`` from the projector, without an event loop; None when none runs (``notice`` said so): replay."""
    report = _projector_report(settings, name, notice)
    return None if report is None else _detail(report, name)


# --- idle --------------------------------------------------------------------------------------------


def idle_adapters(adapters: tuple[m.AdapterStatus, ...], now: datetime,
                  older_than_s: float) -> list[m.AdapterStatus]:
    """The declared adapters nobody asked for in ``older_than_s`` (never, in the fold's memory, included)."""
    return [a for a in adapters if a.last_request is None or (now - a.last_request).total_seconds() >= older_than_s]


IdleAnswer = tuple[list["IdleRow"], datetime, str]  # the rows, the clock used, the source


async def fetch_idle(settings: Settings, older_than_s: float, *, replay: bool = False, now: datetime | None = None,
                     notice: Notice = lambda _: None, use_snapshots: bool = True,
                     model: str | None = None,
                     adapters: list[m.AdapterStatus] | None = None) -> IdleAnswer:
    """Every replica idle ``older_than_s`` or more and every unknown one, the clock used, and the source.

    From the projector's status service when one answers with every event
    stored when we asked folded in (a projector that is behind would see old
    idle maps and overstate idleness); otherwise, or with ``replay``, by
    folding the streams here, which takes longer the longer the history.
    With ``model``, only that model's replicas; a model not declared is an error. ``adapters``, when
    given, is filled with the declared LoRA adapters nobody asked for that long.
    """
    now = now or m.utcnow()
    bus = await connect(settings, "llmgw-ctl-idle")
    try:
        found = None if replay else await _idle_from_projector(bus, older_than_s, now, notice)
        if found is None:
            state = await replay_state(bus, use_snapshots=use_snapshots, notice=notice)
    finally:
        await bus.close()
    if found is not None:
        return _idle_answer(found, "projector", now, older_than_s, model, adapters)
    from llmgw.fleet.status import adapter_status, idle_rows, nobody_asked

    rows = [r for r in idle_rows(state, now) if nobody_asked(r, older_than_s)]
    return _idle_answer((rows, sorted(state.models), adapter_status(state)), "replay", now, older_than_s, model,
                        adapters)


def idle_now(settings: Settings, older_than_s: float, *, now: datetime | None = None, notice: Notice = lambda _: None,
             model: str | None = None, adapters: list[m.AdapterStatus] | None = None) -> IdleAnswer | None:
    """``fetch_idle`` from the projector, without an event loop; None when it did not answer (``notice``
    said why): then ``fetch_idle(replay=True)``. A ``ws://`` URL gets ``fetch_idle`` whole."""
    from llmgw.bus import OneShot, speaks

    now = now or m.utcnow()
    if not speaks(settings):  # a ws:// URL: the Bus asks (and replays itself when the projector does not answer)
        import asyncio

        return asyncio.run(fetch_idle(settings, older_than_s, now=now, notice=notice, model=model, adapters=adapters))
    with OneShot.connect(settings, "llmgw-ctl-idle") as shot:
        heads = {s: shot.stream_last_seq(s) for s in subjects.HISTORY_STREAMS}
        found = _idle_report(lambda req: shot.request(subjects.STATUS, req, service="projector (status service)",
                                                      timeout=CATCH_UP_S + settings.request_timeout_s),
                             older_than_s, now, heads, notice)
    return None if found is None else _idle_answer(found, "projector", now, older_than_s, model, adapters)


def _idle_answer(found: tuple[list[IdleRow], list[str], tuple[m.AdapterStatus, ...]], source: str, now: datetime,
                 older_than_s: float, model: str | None, adapters: list[m.AdapterStatus] | None) -> IdleAnswer:
    rows, declared, listed = found
    if adapters is not None:
        adapters.extend(a for a in idle_adapters(listed, now, older_than_s) if model is None or a.base == model)
    if model is not None:
        # An older projector lists no models: then only its rows can say a name exists.
        if declared and model not in declared and all(r.model != model for r in rows):
            raise LlmgwError(f"no model named {model!r} is declared (declared: {', '.join(declared)}); "
                             "see `llmgw ctl model list`")
        rows = [r for r in rows if r.model == model]
    return rows, now, source


async def _idle_from_projector(bus: Bus, older_than_s: float, now: datetime,
                               notice: Notice) -> tuple[list[IdleRow], list[str], tuple[m.AdapterStatus, ...]] | None:
    """The projector's idle rows and declared models once it has folded what is stored now; None: no projector, or it lags."""
    heads = await stream_heads(bus)
    try:
        data = await bus.request(subjects.STATUS, m.encode(_idle_request(older_than_s, now, heads)),
                                 service="projector (status service)",
                                 timeout=CATCH_UP_S + bus.settings.request_timeout_s)
    except Exception as e:  # noqa: BLE001 - sorted out by _idle_rows, the one place both clients' answers go
        return _idle_rows(None, e, notice)
    return _idle_rows(data, None, notice)


def _idle_request(older_than_s: float, now: datetime, heads: dict[str, int]) -> m.StatusRequest:
    return m.StatusRequest(idle_threshold_s=older_than_s, now=now, wait_for=heads, wait_s=CATCH_UP_S)


def _idle_report(ask: Callable[[bytes], bytes], older_than_s: float, now: datetime, heads: dict[str, int],
                 notice: Notice) -> tuple[list[IdleRow], list[str], tuple[m.AdapterStatus, ...]] | None:
    try:
        data = ask(m.encode(_idle_request(older_than_s, now, heads)))
    except Exception as e:  # noqa: BLE001 - sorted out by _idle_rows
        return _idle_rows(None, e, notice)
    return _idle_rows(data, None, notice)


def _idle_rows(data: bytes | None, error: Exception | None,
               notice: Notice) -> tuple[list[IdleRow], list[str], tuple[m.AdapterStatus, ...]] | None:
    from llmgw.errors import NoServiceError, ServiceError
    from llmgw.fleet.status import IdleRow

    try:
        if error is not None:
            raise error
        assert data is not None
        report = m.STATUS_REPORT_DECODER.decode(data)
    except NoServiceError:
        notice(NO_PROJECTOR)
        return None
    except (ServiceError, msgspec.DecodeError) as e:  # behind, no answer in time, an error, another version
        notice(f"the projector could not answer ({e}): replaying the streams here")
        return None
    # The report's order is idle_rows' order: most GPU-time idle first, unknown last.
    return ([IdleRow(r.replica_id, r.model, r.nodes, r.gpus, r.state, r.idle_s if r.idle_s >= 0 else None,
                     r.idle_since) for r in report.idle], sorted(s.name for s in report.model_list), report.adapters)


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
    bus = await connect(settings, "llmgw-replay")
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
