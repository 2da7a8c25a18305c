"""``ctl what-if``'s reading: the window of history checked, then streamed once to every policy (``llmgw.whatif.policies``).

The fold starts from the newest fold snapshot before ``since`` (``llmgw.fleet.replay``), then
reads the streams in windows of stored time up to ``until``: the week is never in memory.
Within a window the streams are merged by stored time, so each policy sees the fleet as
it was when it decides.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.errors import LlmgwError
from llmgw.fleet.fold import Checkpoint, Memories, fold_batch
from llmgw.fleet.replay import replay
from llmgw.fleet.state import MAX_AHEAD, stored_at
from llmgw.whatif.meter import Figures
from llmgw.whatif.policies import (
    FIDELITY_GOAL,
    FIDELITY_WARN,
    GPU_HOURS_GOAL,
    Outcome,
    Policy,
    Replay,
)

if TYPE_CHECKING:
    from llmgw.bus import Bus
    from llmgw.bus.frames import RawMsg

log = logging.getLogger(__name__)

# The recorded fold in the window only moves the fleet (the policies share it), clamps and refuses.
WINDOW_KEEPS = Memories(history=False, demand=False, observed=False, pool=False, lost=False)
Progress = Callable[[int, int], None] | None
_ENCODER = msgspec.msgpack.Encoder()
_CHECKPOINT = msgspec.msgpack.Decoder(Checkpoint)


class WhatIfError(LlmgwError):
    """A what-if that cannot be answered as asked: the window, a model, a knob."""


class PolicyAnswer(msgspec.Struct, frozen=True, kw_only=True):
    policy: str  # "recorded", or the knobs asked (idle-ttl 15m)
    total: Figures
    models: dict[str, Figures]


class Fidelity(msgspec.Struct, frozen=True, kw_only=True):
    """How much of the recorded history the recorded policy, re-decided, reproduces."""

    reproduced: float  # share of recorded placements and stops made again: same model, within a minute
    recorded_decisions: int
    matched: int
    gpu_hours_recorded: float
    gpu_hours_replayed: float
    gpu_hours_diff: float | None  # (replayed - recorded) / recorded
    trusted: bool  # >= 95 % reproduced


class EngineStart(msgspec.Struct, frozen=True, kw_only=True):
    started_s: float
    healthy_s: float
    source: str


class WhatIfReport(msgspec.Struct, frozen=True, kw_only=True):
    since: datetime
    until: datetime
    models: tuple[str, ...]
    recorded: PolicyAnswer
    asked: tuple[PolicyAnswer, ...]
    fidelity: Fidelity
    engine_start: dict[str, EngineStart]
    events: int
    notes: tuple[str, ...] = ()


async def _first(bus: Bus, stream: str, last: int) -> RawMsg | None:
    """The oldest message a stream still holds."""
    if not last:
        return None
    reader = bus.reader(stream, 1, batch=1, stop_at=last, purpose="what-if first")
    async with contextlib.aclosing(reader.batches()) as batches:  # type: ignore[type-var]
        async for msgs in batches:
            if msgs:
                return msgs[0]
    return None


async def _declared(bus: Bus, name: str, last: int) -> bool:
    if not last:
        return False
    reader = bus.reader(subjects.STREAM_CONTROL, 1, batch=1, stop_at=last,
                        filter_subjects=(subjects.model(name, "declared"),), purpose="what-if model")
    async with contextlib.aclosing(reader.batches()) as batches:  # type: ignore[type-var]
        async for msgs in batches:
            return bool(msgs)
    return False


def _ts(t: datetime) -> str:
    return f"{t:%Y-%m-%d %H:%M:%S} UTC"


async def what_if(bus: Bus, *, since: datetime, until: datetime, policies: list[Policy], models: tuple[str, ...] = (),
                  extra: tuple[m.NodeInventoryReported, ...] = (), progress: Progress = None,
                  use_snapshots: bool = True, warn: Callable[[str], None] | None = None) -> WhatIfReport:
    """The recorded history from ``since`` to ``until`` re-decided under each policy, beside what happened.

    ``extra``: nodes (a fleet file's) the asked policies have besides the recorded fleet.
    """
    if since >= until:
        raise WhatIfError(f"the window is empty: --since {_ts(since)} is not before --until {_ts(until)}")
    heads = {s: await bus.stream_head(s) for s in subjects.HISTORY_STREAMS}
    firsts = {s: await _first(bus, s, heads[s][0]) for s in subjects.HISTORY_STREAMS}
    held = [x for x in firsts.values() if x is not None]
    if not held:
        raise WhatIfError("the streams hold no history yet: nothing to replay")
    first = stored_at(min(x.ts_ns for x in held))
    notes: list[str] = []
    if since < first:
        # A window that starts before the history starts where the history does (as a TTL longer than the
        # window is taken), said in a note: `--since 1h` on a younger control plane is the common case.
        if first >= until:
            raise WhatIfError(f"the window ends ({_ts(until)}) before the first event stored ({_ts(first)})")
        notes.append(f"the history starts at {_ts(first)}, after --since {_ts(since)}: the window starts there")
        since = first
    usage = firsts[subjects.STREAM_USAGE]
    if usage is not None and usage.seq > 1 and stored_at(usage.ts_ns) > since:
        cut = stored_at(usage.ts_ns)
        if cut >= until:
            raise WhatIfError(f"the usage stream no longer holds any demand of the window (its 30-day retention "
                              f"dropped everything before {_ts(cut)}); give --since {cut:%Y-%m-%dT%H:%M:%S} or later")
        notes.append(f"the usage stream no longer holds demand before {_ts(cut)} (its 30-day retention): the window "
                     f"starts there, not at {_ts(since)}")
        since = cut
    for name in models:
        if not await _declared(bus, name, heads[subjects.STREAM_CONTROL][0]):
            raise WhatIfError(f"no model named {name!r} was ever declared; `llmgw ctl model list` lists the models")

    c = await replay(bus, at=since, use_snapshots=use_snapshots, warn=warn)
    clash = sorted(n.node for n in extra if n.node in c.state.nodes)
    if clash:
        raise WhatIfError(f"--fleet adds nodes, and {', '.join(clash)} already report to the fleet; name the new "
                          "nodes otherwise")
    if extra:
        gpus = sum(len(n.gpus) for n in extra)
        notes.append(f"the asked policies have {len(extra)} more node{'s' if len(extra) != 1 else ''} ({gpus} GPUs, "
                     "from --fleet); the recorded one does not")
    run: Replay | None = None
    offset = last_offset = timedelta(0)
    cuts = {s: int(until.timestamp() * 1e9) for s in subjects.HISTORY_STREAMS}
    readers = {}
    total = 0
    for stream, (last, _) in heads.items():
        start = c.cursor.positions.get(stream, 0) + 1
        if start <= last:
            readers[stream] = bus.reader(stream, start, stop_at=last, idle_expires_s=2.0, purpose="what-if")
            total += last - start + 1
    from llmgw.bus import windows

    done = events = undecodable = 0

    def skip(_raw: RawMsg, _e: Exception) -> None:
        nonlocal undecodable
        undecodable += 1

    begin: Checkpoint | None = None
    async with contextlib.aclosing(windows(readers, cuts)) as merged:  # type: ignore[type-var]
        async for window in merged:
            if run is None:
                # What every policy starts from: the fold before this window. A window's control and usage
                # events are folded whole before its events are fed one by one, so ``c`` is ahead by then.
                begin = _CHECKPOINT.decode(_ENCODER.encode(c))
            runs: list[list[tuple[int, int, str, RawMsg, Any, list[str] | None]]] = []
            for stream, msgs in window:
                done += len(msgs)
                stored, decoded = m.decode_each(stream, msgs, subjects.DECODERS[stream].decode, skip, who="what-if")
                if stream == subjects.STREAM_FLEET:
                    runs.append([(x.ts_ns, i, stream, x, e, None) for i, (x, e) in
                                 enumerate(zip(stored, decoded, strict=True))])
                    continue
                moved: dict[int, list[str] | None] = {}  # each idle map's one diff, as the fold computed it
                why = fold_batch(c, stream, stored, decoded, keep=WINDOW_KEEPS,  # clamps the times in place
                                 before=lambda i, _, diff: moved.__setitem__(i, diff))  # noqa: B023 - called here
                runs.append([(x.ts_ns, i, stream, x, e, moved.get(i)) for i, (x, e, w) in
                             enumerate(zip(stored, decoded, why, strict=True)) if w is None])
            # In the events' own order: a history imported at once was stored in microseconds, in no
            # order across its streams; a live one was stored as it happened, and this changes nothing.
            for _, _, stream, x, event, diff in heapq.merge(*runs, key=lambda r: (r[4].at, r[0])):
                if stream == subjects.STREAM_FLEET:
                    one = [event]
                    if fold_batch(c, stream, [x], one, keep=WINDOW_KEEPS)[0] is not None:
                        continue
                    event = one[0]
                last_offset = _offset(event.at, x.ts_ns)
                if run is None:
                    # The window is in stored time, the figures in event time: the same clock for a live
                    # history, not for one imported (or generated) at once. The first event says how far apart.
                    offset = last_offset
                    assert begin is not None
                    run = Replay(begin, policies, since + offset, extra, live=c.state)
                run.feed(stream, event, diff)
                events += 1
            if progress is not None:
                progress(done, total)
    if run is None:
        raise WhatIfError(f"no event was stored between {_ts(since)} and {_ts(until)}: the window is empty")
    if undecodable:
        notes.append(f"{undecodable} stored message{'s' if undecodable != 1 else ''} could not be decoded and "
                     "were left out")
    if offset:
        notes.append(f"the events were stored {human(offset)} from their own times (imported at once): the window is "
                     "read in stored time, the figures in the events' times")
    window_s = (until + last_offset - since - offset).total_seconds()
    for p in policies:
        for name, ttl in p.idle_ttl:
            if ttl is not None and ttl >= window_s:
                notes.append(f"{p.label}: an idle TTL of {ttl:g}s{' for ' + name if name else ''} is longer than the "
                             "window: no replica can reach it there (the same as never)")
    out = run.finish(until + last_offset, models)
    return _report(out, policies, since + offset, until + last_offset, models, events, notes)


def _offset(at: datetime, ts_ns: int) -> timedelta:
    """How far an event's time is from when it was stored; nothing when within the fold's clamp window."""
    d = at - stored_at(ts_ns)
    return d if abs(d) > MAX_AHEAD else timedelta(0)


def human(d: timedelta) -> str:
    s = abs(d.total_seconds())
    return f"{s / 86400:.1f} days" if s >= 86400 else f"{s / 3600:.1f} hours" if s >= 3600 else f"{s:.0f}s"


def _pick(figures: dict[str, Figures], models: tuple[str, ...]) -> dict[str, Figures]:
    return {k: v for k, v in figures.items() if not models or k in models}


def _report(out: Outcome, policies: list[Policy], since: datetime, until: datetime, models: tuple[str, ...],
            events: int, notes: list[str]) -> WhatIfReport:
    recorded = PolicyAnswer(policy="recorded", total=out.recorded_total, models=_pick(out.recorded, models))
    asked = tuple(PolicyAnswer(policy=p.label, models=_pick(out.asked[p.label], models), total=out.asked_total[p.label])
                  for p in policies)
    fid = Fidelity(reproduced=round(out.reproduced, 4), recorded_decisions=out.recorded_decisions, matched=out.matched,
                   gpu_hours_recorded=out.recorded_all.gpu_hours, gpu_hours_replayed=out.replayed_total.gpu_hours,
                   gpu_hours_diff=None if out.gpu_hours_diff is None else round(out.gpu_hours_diff, 4),
                   trusted=out.reproduced >= FIDELITY_WARN)
    if out.recorded_decisions == 0:
        notes.append("the scheduler placed and stopped nothing in the window: fidelity has nothing to check")
    elif out.reproduced < FIDELITY_GOAL:
        notes.append(f"the recorded policy re-decided reproduces {out.reproduced:.1%} of the recorded placements "
                     f"and stops (goal {FIDELITY_GOAL:.0%})")
    if out.gpu_hours_diff is not None and abs(out.gpu_hours_diff) > GPU_HOURS_GOAL:
        notes.append(f"the recorded policy re-decided holds {out.gpu_hours_diff:+.1%} of the recorded GPU-hours "
                     f"(goal ±{GPU_HOURS_GOAL:.0%})")
    for label, (moved, unmoved) in out.whole_start.items():
        if moved or unmoved:
            n = moved + unmoved
            notes.append(f"{label}: {n} replica{'s' if n != 1 else ''} not exclusive ran at the window's start: "
                         f"{moved} placed again there on whole GPUs, {unmoved} found none (stopped there; their "
                         "models wait for room)")
    starts = {k: EngineStart(started_s=round(s, 2), healthy_s=round(h, 2), source=src)
              for k, (s, h, src) in out.starts.items() if not models or k in models}
    return WhatIfReport(since=since, until=until, models=models, recorded=recorded, asked=asked, fidelity=fid,
                        engine_start=starts, events=events, notes=tuple(notes))
