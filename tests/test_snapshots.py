"""Fold snapshots on the bus: a fold from a snapshot equals the fold from sequence 1, and a bad one is skipped."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from projection_events import event_lists, random_event, small_fleet
from running import until
from streams import fresh_streams, publish

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.config import Settings
from llmgw.fleet import snapshots
from llmgw.fleet.fold import EVERY, Checkpoint, encode, encode_state
from llmgw.fleet.pool import Pool
from llmgw.fleet.replay import STATUS_KEEPS, replay
from llmgw.fleet.state import FOLD_VERSION
from llmgw.fleet.status import idle_rows, report
from llmgw.projections.runner import Projector
from llmgw.projections.store import Store
from llmgw.router.endpoints import EndpointSink
from llmgw.scheduler import placement as scheduler
from llmgw.scheduler.service import FOLLOWED, SchedulerService

LLMGW = str(Path(sys.executable).with_name("llmgw"))
EXAMPLE_MODELS = Path(__file__).resolve().parent.parent / "examples" / "models"
T_NONE = datetime(2026, 1, 1, tzinfo=UTC)  # "now" for a fold with no event yet


async def project(bus: Bus, path: Path, every: int) -> int:
    """Project what is stored, committing and snapshotting every ``every`` events; snapshots written."""
    store = Store(path)
    try:
        projector = Projector(bus, store, commit_every=every, batch=every, fold_snapshot_events=every)
        await projector.run_once()
        return projector.fold_snapshots_written
    finally:
        store.close()


async def both_ways(bus: Bus, **target: object) -> tuple[bytes, bytes]:
    """What every reader takes from a fold, from the newest fitting snapshot and from sequence 1: the status
    report (with the models' history), idle rows, the scheduler's decisions and demand memory, the planner's
    observed reservations, the routers' pool and the liveness monitor's lost nodes."""
    out = []
    for use in (True, False):
        warned: list[str] = []
        c = await replay(bus, use_snapshots=use, warn=warned.append, **target)  # type: ignore[arg-type]
        assert warned == [], warned
        now = c.state.as_of
        decisions = [(d.msg_id, m.encode(d.event)) for d in scheduler.decide(c.state, c.demand, now or T_NONE)]
        out.append(m.encode(report(c.state, now, 60.0, c.cursor, history=c.history, replicas=True))
                   + msgspec.json.encode(idle_rows(c.state, now))
                   + msgspec.msgpack.encode([c.history, decisions, c.observed, c.demand, pool_view(c.pool),
                                           c.lost_at_seq]))
    return out[0], out[1]


def pool_view(pool: Pool) -> tuple[object, ...]:
    """A router's pool as values (its Replica objects compare by identity)."""
    reps = sorted((r.replica_id, r.model, r.state, r.endpoint, r.in_pool, r.nodes, sorted(r.parts.items()))
                  for r in pool.replicas.values())
    healthy = sorted((model, sorted(r.replica_id for r in reps_)) for model, reps_ in pool.healthy.items())
    return reps, healthy, sorted(pool.known_models), sorted(pool.declared.items())


@hsettings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=event_lists, every=st.integers(1, 5), targets=st.data())
async def test_a_fold_from_any_snapshot_equals_the_fold_from_sequence_1(
    bus: Bus, tmp_path: Path, events: list[m.Event | bytes], every: int, targets: st.DataObject,
) -> None:
    await fresh_streams(bus)
    last = await publish(bus, events)
    db = tmp_path / f"p-{abs(hash((repr(events), every)))}.duckdb"
    db.unlink(missing_ok=True)
    assert await project(bus, db, min(every, len(events))) >= 1
    heads = {s: await bus.stream_head(s) for s in subjects.HISTORY_STREAMS}
    now = snapshots.Target(stops={s: h[0] for s, h in heads.items()}, cut_ns={})
    assert await snapshots.load(bus, now, heads, pytest.fail) is not None  # the fold below starts from one
    with_snap, from_one = await both_ways(bus)
    assert with_snap == from_one
    # And right after any stored message of any stream: snapshots past it must not be used.
    for _ in range(3):
        stream = targets.draw(st.sampled_from(sorted(last)), label="stream")
        seq = targets.draw(st.integers(1, last[stream]), label="seq")
        with_snap, from_one = await both_ways(bus, at_seq=(stream, seq))
        assert with_snap == from_one, (stream, seq)


async def test_a_replica_placed_again_under_its_id_leaves_a_snapshot_that_checks_out(bus: Bus, tmp_path: Path) -> None:
    """Found by the test above: r0 placed on n0, then again on n1. The pool took the second placement's
    nodes but kept naming the first, so every snapshot after it was refused as unfounded."""
    events = [random_event(0, i, 0, 0) for i in range(3)] + [random_event(4, 3, 0, 0), random_event(4, 4, 1, 0)]
    await fresh_streams(bus)
    await publish(bus, events)
    assert await project(bus, tmp_path / "p.duckdb", 1) >= 1
    heads = {s: await bus.stream_head(s) for s in subjects.HISTORY_STREAMS}
    now = snapshots.Target(stops={s: h[0] for s, h in heads.items()}, cut_ns={})
    found = await snapshots.load(bus, now, heads, pytest.fail)
    assert found is not None and found[0].pool.replicas["r0"].nodes == found[0].state.replicas["r0"].nodes
    with_snap, from_one = await both_ways(bus)
    assert with_snap == from_one


async def test_a_due_snapshot_waits_its_turn_rather_than_being_skipped(bus: Bus, tmp_path: Path) -> None:
    # Folding 30 events takes far less than writing a snapshot to the object store: one due while the
    # last is still being written used to be skipped, and a gap of twice the cadence is an --at that
    # folds twice as far (issue 46).
    await fresh_streams(bus)
    await publish(bus, [random_event(0, i, i, i) for i in range(600)])  # all on the fleet stream
    store = Store(tmp_path / "p.duckdb")
    try:
        projector = Projector(bus, store, commit_every=30, batch=10, fold_snapshot_events=30)
        await projector.run_once()
        written = projector.fold_snapshots_written
    finally:
        store.close()
    headers = await snapshots.list_headers(bus)
    folded = sorted(sum(h.positions.values()) for h in headers.values())
    # Due every 30 events, taken at the end of the read window (20 events here) that passes them.
    assert written == len(folded) >= 12, (written, folded)
    assert all(b - a < 60 for a, b in zip([0, *folded], folded, strict=False)), folded


async def test_status_at_a_moment_folds_only_the_memories_its_report_reads(bus: Bus, tmp_path: Path) -> None:
    # `ctl status --at` folded the scheduler's, planner's, routers' and liveness memories too, a sixth of
    # its fold, and reports none of them (issue 46): the report is the same without them.
    await fresh_streams(bus)
    events = [*small_fleet(), *(random_event(i % 8, 100 + i, i, i // 3) for i in range(80))]
    await publish(bus, [e for e in events if not isinstance(e, bytes)])
    assert await project(bus, tmp_path / "p.duckdb", 25) >= 2  # --at starts from a snapshot with every memory
    last = await bus.stream_last_seq(subjects.STREAM_CONTROL)
    for seq in range(1, last + 1, 7):
        reports = []
        for keep in (STATUS_KEEPS, EVERY):
            c = await replay(bus, at_seq=(subjects.STREAM_CONTROL, seq), keep=keep)
            reports.append(m.encode(report(c.state, c.state.as_of, 60.0, c.cursor, history=c.history, replicas=True)))
        assert reports[0] == reports[1], seq
    assert STATUS_KEEPS.history and not (STATUS_KEEPS.demand or STATUS_KEEPS.pool or STATUS_KEEPS.observed)


async def test_a_catch_up_snapshots_at_the_cadence_however_large_its_read_windows(bus: Bus, tmp_path: Path) -> None:
    # A rebuild reads windows of thousands of events: a snapshot taken only between two of them lands up
    # to a window past its cadence (33k events after the one before at 25k, issue 46), and an --at just
    # before it folds that much more. The window is cut at the stored time where the snapshot falls due.
    await fresh_streams(bus)
    await publish(bus, [random_event(0 if i % 2 else 3, i, i, i) for i in range(600)])  # fleet and control
    store = Store(tmp_path / "p.duckdb")
    try:
        await Projector(bus, store, commit_every=1000, batch=200, fold_snapshot_events=30).run_once()
    finally:
        store.close()
    folded = sorted(sum(h.positions.values()) for h in (await snapshots.list_headers(bus)).values())
    assert len(folded) >= 19 and all(30 <= b - a <= 32 for a, b in zip([0, *folded], folded[:-1], strict=False)), folded
    with_snap, from_one = await both_ways(bus, at_seq=(subjects.STREAM_CONTROL, 150))
    assert with_snap == from_one


async def test_the_projector_writes_snapshots_that_a_replay_starts_from(bus: Bus, tmp_path: Path) -> None:
    await fresh_streams(bus)
    await publish(bus, small_fleet())
    assert await project(bus, tmp_path / "p.duckdb", 4) >= 2
    headers = await snapshots.list_headers(bus)
    heads = {s: await bus.stream_head(s) for s in subjects.HISTORY_STREAMS}
    target = snapshots.Target(stops={s: h[0] for s, h in heads.items()}, cut_ns={})
    found = await snapshots.load(bus, target, heads, pytest.fail)
    assert found is not None
    checkpoint, name = found
    assert name == max(headers)  # the newest
    assert checkpoint.cursor.positions == headers[name].positions
    assert all(h.fold_version == FOLD_VERSION for h in headers.values())


async def _write_bad(bus: Bus, name_suffix: str, **change: object) -> None:
    """A snapshot of the whole history, with one thing wrong."""
    c = await replay(bus, use_snapshots=False)
    blob = encode_state(c.state, c.cursor, c.history)
    header = snapshots.header_for(blob, c.cursor, 10**18)
    header = msgspec.structs.replace(header, **change)
    name = snapshots.object_name(header) + name_suffix
    await bus.objects(subjects.SNAPSHOT_BUCKET).put(name, blob, msgspec.json.encode(header).decode())


@pytest.mark.parametrize("change, why", [
    ({"sha256": "0" * 64}, "checksum does not match"),
    ({"fold_version": FOLD_VERSION + 1}, f"fold version {FOLD_VERSION + 1}"),
    ({"format": 99}, "format 99"),
    ({"positions": {subjects.STREAM_FLEET: 10**6}}, "past the stream's end"),
    ({"stream_created": {subjects.STREAM_FLEET: "2001-01-01T00:00:00+00:00"}}, "declared again"),
])
async def test_a_bad_snapshot_is_skipped_with_one_line_and_the_fold_is_still_right(
    bus: Bus, change: dict[str, object], why: str,
) -> None:
    await fresh_streams(bus)
    await publish(bus, small_fleet())
    await _write_bad(bus, "", **change)
    warned: list[str] = []
    c = await replay(bus, warn=warned.append)
    assert len(warned) == 1 and why in warned[0], warned
    assert c == await replay(bus, use_snapshots=False)


async def test_a_snapshot_whose_bytes_were_changed_is_caught_by_its_checksum(bus: Bus) -> None:
    await fresh_streams(bus)
    await publish(bus, small_fleet())
    c = await replay(bus, use_snapshots=False)
    blob = encode_state(c.state, c.cursor, c.history)
    header = snapshots.header_for(blob, c.cursor, 10**18)
    tampered = blob.replace(b"H100-80GB", b"H200-80GB", 1)
    assert hashlib.sha256(tampered).hexdigest() != header.sha256
    await bus.objects(subjects.SNAPSHOT_BUCKET).put(snapshots.object_name(header), tampered,
                                                    msgspec.json.encode(header).decode())
    warned: list[str] = []
    assert await replay(bus, warn=warned.append) == c
    assert len(warned) == 1 and "checksum" in warned[0]


async def _forge(bus: Bus, change: Callable[[Checkpoint], None]) -> str:
    """The newest snapshot, rewritten by ``change`` and stored with a checksum that matches: what anyone
    who may write snapshots could do. The name it is stored under."""
    c = await replay(bus, use_snapshots=False)
    change(c)
    blob = encode(c)
    header = snapshots.header_for(blob, c.cursor, 10**18)
    name = snapshots.object_name(header) + "-forged"
    await bus.objects(subjects.SNAPSHOT_BUCKET).put(name, blob, msgspec.json.encode(header).decode())
    return name


async def restarted_router(bus: Bus) -> EndpointSink:
    """A router's pool as a router starting now builds it (from the newest snapshot that checks out)."""
    sink = EndpointSink(bus)
    task = asyncio.create_task(sink.run())
    try:
        await until(sink.caught_up.is_set, "the router's pool caught up")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return sink


async def caught_up_scheduler(bus: Bus, *, use_snapshots: bool | None = None) -> SchedulerService:
    """A scheduler (as it starts by default, or told whether to start from a snapshot) that has folded
    every followed stream as stored now; it decides nothing."""
    svc = SchedulerService(bus) if use_snapshots is None else SchedulerService(bus, use_snapshots=use_snapshots)
    if svc.use_snapshots:
        await svc.start_from_snapshot()
    tasks = [asyncio.create_task(svc._follow(s)) for s in FOLLOWED]
    try:
        await until(svc._caught_up, "the scheduler's fold caught up")
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return svc


EVIL = "http://203.0.113.9:8000"  # TEST-NET-3: nothing of ours, never dialled


def _endpoint(c: Checkpoint) -> None:
    (rid,) = [r.replica_id for r in c.state.replicas.values() if r.endpoint]
    c.state.replicas[rid].endpoint = c.pool.replicas[rid].endpoint = EVIL


def _ghost(c: Checkpoint) -> None:
    # A replica nobody placed, holding a GPU, with the sequence of a real placement.
    real = next(iter(c.state.replicas.values()))
    c.state.replicas["ghost-r1"] = dataclasses.replace(real, replica_id="ghost-r1", endpoint="")


def _moved(c: Checkpoint) -> None:
    # A real placement's GPUs swapped for others: the stored ReplicaPlaced says otherwise.
    real = next(iter(c.state.replicas.values()))
    real.gpus = tuple(msgspec.structs.replace(g, index=g.index + 1) for g in real.gpus)


def _unsourced(c: Checkpoint) -> None:
    for r in c.pool.replicas.values():
        r.endpoint, r.endpoint_seq = EVIL, 0


@pytest.mark.parametrize("change, why", [
    (_endpoint, "endpoint http://203.0.113.9:8000"),
    (_ghost, "replica ghost-r1's placement is not what"),
    (_moved, "placement is not what"),
    (_unsourced, "names no control message"),
])
async def test_a_snapshot_cannot_say_what_the_streams_do_not(
    bus: Bus, change: Callable[[Checkpoint], None], why: str,
) -> None:
    """A lying snapshot with a valid checksum: refused with one line, and no reader routes or places on it."""
    await fresh_streams(bus)
    await publish(bus, small_fleet()[:17])  # a replica healthy, with its endpoint
    forged = await _forge(bus, change)
    warned: list[str] = []
    c = await replay(bus, warn=warned.append)
    assert len(warned) == 1 and forged in warned[0] and why in warned[0], warned
    assert c == await replay(bus, use_snapshots=False)
    # The router's pool, as a restarted router builds it: never the forged endpoint.
    sink = await restarted_router(bus)
    assert sink.started_from != forged
    endpoints = {r.endpoint for r in sink.pool.replicas.values()}
    assert EVIL not in endpoints and any(r.in_pool for r in sink.pool.replicas.values())


async def _stored_ns(bus: Bus, stream: str, seq: int) -> int | None:
    """When ``stream`` stored message ``seq``; None past its end."""
    if seq > await bus.stream_last_seq(stream):
        return None
    async for msgs in bus.reader(stream, seq, batch=1, stop_at=seq).batches():
        return msgs[0].ts_ns
    return None


async def test_snapshots_written_while_catching_up_are_moments_that_existed(bus: Bus, tmp_path: Path) -> None:
    """A rebuild reads the streams in windows of stored time: each snapshot holds every message stored
    up to its newest one, from every stream, and none after (before, each stream was read on its own
    and a snapshot could hold control from today with usage from last week)."""
    await fresh_streams(bus)
    events = small_fleet()
    # Interleaved in stored time: usage between fleet and control events, in rounds.
    for i in range(0, len(events), 3):
        await publish(bus, events[i:i + 3])
        await publish(bus, [m.IdleMapPublished(at=events[i].at, router="rt-x", boot_id="x1", tick=i + 1)])
    assert await project(bus, tmp_path / "p.duckdb", 2) >= 3
    headers = await snapshots.list_headers(bus)
    for name, h in headers.items():
        moment = h.newest_ns
        for stream in subjects.HISTORY_STREAMS:
            position = h.positions.get(stream, 0)
            if position:
                assert h.stored_ns[stream] <= moment
            after = await _stored_ns(bus, stream, position + 1)
            assert after is None or after > moment, (name, stream, position)


async def test_a_pool_entry_beside_the_replicas_is_never_routed_to(bus: Bus) -> None:
    """A forged snapshot whose routers' pool lists a replica in ``healthy`` but not in ``replicas`` (no
    claim to check): the pool is rebuilt from its replicas, so the forged endpoint is never in it."""
    from llmgw.fleet.pool import Replica

    await fresh_streams(bus)
    await publish(bus, small_fleet()[:17])

    def slip_in(c: Checkpoint) -> None:
        c.pool.replicas = {}  # nothing left to check: before, `healthy` then survived the decode as written
        c.pool.healthy["qwen-8b"] = [Replica(replica_id="ghost", model="qwen-8b", state="healthy", endpoint=EVIL,
                                             in_pool=True, nodes=("n1",))]

    await _forge(bus, slip_in)
    sink = await restarted_router(bus)
    assert all(r.endpoint != EVIL for reps in sink.pool.healthy.values() for r in reps)
    assert "ghost" not in {r.replica_id for reps in sink.pool.healthy.values() for r in reps}


async def test_a_snapshot_that_leaves_out_a_stop_is_refused(bus: Bus) -> None:
    """A replica the control stream stopped after its placement, kept alive in a snapshot whose cursor
    is past the stop: refused, so no router sends traffic to the old endpoint."""
    await fresh_streams(bus)
    events = small_fleet()[:18]  # r-qwen healthy on n1
    await publish(bus, events)
    kept = await replay(bus, use_snapshots=False)
    (rid,) = [r.replica_id for r in kept.state.replicas.values() if r.endpoint and len(r.nodes) == 1]
    model = kept.state.replicas[rid].model
    await bus.publish(m.ReplicaStopped(at=events[-1].at, replica_id=rid, model=model, reason="idle: test"))
    truth = await replay(bus, use_snapshots=False)
    kept.cursor = truth.cursor  # it claims to have read the stop
    blob = encode(kept)
    header = snapshots.header_for(blob, kept.cursor, 10**18)
    await bus.objects(subjects.SNAPSHOT_BUCKET).put(snapshots.object_name(header) + "-forged", blob,
                                                    msgspec.json.encode(header).decode())
    warned: list[str] = []
    assert await replay(bus, warn=warned.append) == truth
    assert len(warned) == 1 and f"replica {rid} was stopped at" in warned[0], warned


async def test_the_scheduler_places_by_the_streams_never_by_a_snapshot(bus: Bus) -> None:
    """A snapshot is checked for placements and endpoints, not for the models, nodes and demand the
    scheduler decides from: a forged model with engine arguments must never be placed, so by default
    the scheduler folds from sequence 1 (``--from-snapshot`` trusts the snapshot writer)."""
    from llmgw.fleet.state import ModelView

    await fresh_streams(bus)
    events = small_fleet()
    await publish(bus, events)
    evil = msgspec.structs.replace(events[8].spec, name="evil", engine_args=("--trust-remote-code",))  # type: ignore[attr-defined]

    def declare(c: Checkpoint) -> None:
        c.state.models["evil"] = ModelView(spec=evil, replicas_wanted=4, declared_at=events[-1].at)

    await _forge(bus, declare)
    svc = await caught_up_scheduler(bus)
    assert not svc.use_snapshots
    assert "evil" not in svc.state.models and not svc.stats.started_from
    decided = scheduler.decide(svc.state, svc.memory, events[-1].at)
    assert all(getattr(d.event, "model", "") != "evil" for d in decided)


def test_retention_keeps_the_newest_then_hourly_for_a_week_then_daily() -> None:
    now = 400 * snapshots.DAY_NS
    hour, day = snapshots.HOUR_NS, snapshots.DAY_NS
    # One snapshot every 20 minutes for 100 days.
    headers = {f"s{i:06d}": snapshots.Header(format=1, fold_version=1, positions={}, stored_ns={}, stream_created={},
                                             sha256="", size=0, taken_ns=now - i * hour // 3)
               for i in range(100 * 24 * 3)}
    kept = sorted(set(headers) - set(snapshots.expired(headers, now)), key=lambda n: -headers[n].taken_ns)
    ages = [now - headers[n].taken_ns for n in kept]
    assert kept[:snapshots.KEEP_NEWEST] == sorted(headers)[:snapshots.KEEP_NEWEST]  # the newest, all of them
    older = ages[snapshots.KEEP_NEWEST:]
    week = [a for a in older if a <= 7 * day]
    assert len(week) == len({(now - a) // hour for a in week})  # at most one per hour
    assert all(a <= 90 * day for a in older)  # nothing past 90 days
    assert len([a for a in older if a > 7 * day]) == len({(now - a) // day for a in older if a > 7 * day})
    assert len(kept) < 48 + 7 * 24 + 90


async def test_ctl_status_replay_says_it_skipped_a_snapshot_and_no_snapshot_folds_from_1(
    bus: Bus, settings: Settings,
) -> None:
    await fresh_streams(bus)
    await publish(bus, small_fleet())
    await _write_bad(bus, "", fold_version=FOLD_VERSION + 1)
    env_url = ["--nats-url", settings.nats_url]
    outs = []
    for extra in ((), ("--no-snapshot",)):
        proc = await asyncio.create_subprocess_exec(
            LLMGW, "ctl", "status", "--replay", "--json", *extra, *env_url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        outs.append((out, err.decode()))
    assert outs[0][0] == outs[1][0]
    assert "skipped: fold version" in outs[0][1] and outs[0][1].count("\n") == 1
    assert "skipped" not in outs[1][1]


async def snapshot_then_more(bus: Bus, tmp_path: Path, before: list[m.Event], after: list[m.Event]) -> None:
    """Fresh streams holding ``before``, projected with fold snapshots, then ``after`` stored past the newest one."""
    await fresh_streams(bus)
    await publish(bus, before)
    assert await project(bus, tmp_path / "p.duckdb", 4) >= 1
    await publish(bus, after)


async def test_a_scheduler_starts_from_the_newest_snapshot_and_decides_as_one_from_sequence_1(
    bus: Bus, tmp_path: Path,
) -> None:
    """Its fold and demand memory come from the snapshot; it reads only what came after."""

    events = small_fleet()
    await snapshot_then_more(bus, tmp_path, events[:15], events[15:])

    from_snapshot, from_one = await caught_up_scheduler(bus, use_snapshots=True), await caught_up_scheduler(bus)
    assert from_snapshot.stats.started_from and not from_one.stats.started_from
    assert from_snapshot.checkpoint.cursor.positions[subjects.STREAM_CONTROL] > 0  # it did skip events
    now = events[-1].at
    decide = [[(d.msg_id, m.encode(d.event)) for d in scheduler.decide(s.state, s.memory, now)]
              for s in (from_snapshot, from_one)]
    assert decide[0] == decide[1] and decide[0]  # the same, and not trivially
    assert from_snapshot.memory == from_one.memory


async def test_a_planner_starts_from_the_newest_snapshot_and_sees_the_fleet_as_one_from_sequence_1(
    bus: Bus, tmp_path: Path,
) -> None:
    from llmgw.planner import candidates as planner
    from llmgw.planner.service import PlannerService

    events = small_fleet()
    await snapshot_then_more(bus, tmp_path, events[:15], events[15:])
    seen = []
    for use in (True, False):
        svc = PlannerService(bus, use_snapshots=use)
        task = asyncio.create_task(svc.run())
        try:
            await until(svc.ready.is_set, "the planner ready")
            seen.append((svc.started_from, planner.pools(svc.state), svc.observed, svc.state.nodes, svc.state.replicas))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert seen[0][0] and not seen[1][0]
    assert seen[0][1:] == seen[1][1:] and seen[0][1]


async def test_a_planner_started_from_a_snapshot_plans_for_the_engine_version_the_agents_reported(
    bus: Bus, tmp_path: Path,
) -> None:
    """The versions are in the fold: no inventory after the snapshot is needed to know what the fleet runs."""
    from llmgw.planner.service import PlannerService

    events = [msgspec.structs.replace(e, vllm_version="0.17.1") if isinstance(e, m.NodeInventoryReported) else e
              for e in small_fleet()]
    assert all(isinstance(e, m.NodeInventoryReported) for e in events[:5])
    assert not any(isinstance(e, m.NodeInventoryReported) for e in events[15:])
    await snapshot_then_more(bus, tmp_path, events[:15], events[15:])
    request = m.encode(m.PlanRequest(model="meta-llama/Llama-3.1-8B-Instruct", precisions=("bf16",), tp=(1,)))
    replies = []
    for use in (True, False):
        svc = PlannerService(bus, models_dir=EXAMPLE_MODELS, use_snapshots=use)
        task = asyncio.create_task(svc.run())
        try:
            await until(svc.ready.is_set, "the planner ready")
            assert bool(svc.started_from) == use
            assert svc.state.nodes["n1"].vllm_version == "0.17.1"
            replies.append(m.PLAN_REPLY_DECODER.decode(await svc.handle(request)))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    for reply in replies:
        assert (reply.engine_version, reply.engine_profile, reply.engine_version_source) == (
            "0.17.1", "vllm 0.16–0.19", "fleet")
        assert reply.candidates and all(c.engine_version == "0.17.1" for c in reply.candidates if c.engine == "vllm")
    assert replies[0] == replies[1]


async def test_a_router_starts_from_the_newest_snapshot_with_the_pool_of_one_from_sequence_1(
    bus: Bus, tmp_path: Path,
) -> None:
    events = small_fleet()
    await snapshot_then_more(bus, tmp_path, events[:16], events[16:])  # a replica healthy before the snapshot
    seen = []
    for use in (True, False):
        sink = EndpointSink(bus, use_snapshots=use)
        task = asyncio.create_task(sink.run())
        try:
            await until(sink.caught_up.is_set, "the router's pool caught up")
            seen.append((sink.started_from, pool_view(sink.pool), {r.replica_id: r.pooled_at > 0 for r in
                                                                   sink.pool.replicas.values() if r.in_pool}))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert seen[0][0] and not seen[1][0]
    assert seen[0][1] == seen[1][1] and seen[0][1][1]  # the same pool, with healthy replicas in it
    assert all(seen[0][2].values())  # pooled by this router now, not at 0


async def test_a_liveness_monitor_starts_from_the_newest_snapshot_with_the_lost_nodes_of_one_from_1(
    bus: Bus, tmp_path: Path,
) -> None:
    from llmgw.scheduler.liveness import HeartbeatMonitor

    events = small_fleet()  # n5 is lost in it
    at = events[-1].at
    await snapshot_then_more(bus, tmp_path,
                             [*events, m.NodeLost(at=at, node="n2"), m.NodeLost(at=at, node="n3"),
                              m.NodeReturned(at=at, node="n3")],
                             [m.NodeLost(at=at, node="n4"), m.NodeReturned(at=at, node="n2")])
    seen = []
    for use in (True, False):
        monitor = HeartbeatMonitor(bus, use_snapshots=use)
        await monitor._load_lost()
        seen.append((monitor.started_from, {n: x.stream_seq for n, x in monitor.lost.items()}))
    assert seen[0][0] and not seen[1][0]
    assert seen[0][1] == seen[1][1] and set(seen[0][1]) == {"n5", "n4"}


def test_a_checkpoints_bytes_do_not_depend_on_the_process_that_folded_it() -> None:
    """Seen as a flaky crash test: the router pool's set of model names was encoded in the order
    that process's string hash seed gave it, so a projector resumed after a crash wrote other bytes
    than one that never crashed (1 run in 10)."""
    import subprocess

    code = (
        "import hashlib, sys; sys.path.insert(0, 'tests')\n"
        "from projection_events import small_fleet\n"
        "from llmgw import subjects\n"
        "from llmgw.fleet.fold import Checkpoint, encode, fold_batch\n"
        "from llmgw.bus.frames import RawMsg\n"
        "c = Checkpoint()\n"
        "for i, e in enumerate(small_fleet()):\n"
        "    subject = subjects.subject_for(e)\n"
        "    stored = RawMsg(subject=subject, seq=i + 1, ts_ns=int(e.at.timestamp() * 1e9), data=b'')\n"
        "    fold_batch(c, subjects.stream_for_subject(subject), [stored], [e])\n"
        "print(hashlib.sha256(encode(c)).hexdigest())\n"
    )
    root = Path(__file__).resolve().parent.parent
    digests = {subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in range(1, 7)}
    assert len(digests) == 1, digests
