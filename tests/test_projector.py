"""The projector against a real nats-server and real DuckDB files: commit, crash, resume, serve."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
from pathlib import Path
from typing import Any

import duckdb
import msgspec
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from projection_events import BAD, event_lists, random_event, small_fleet, t
from streams import fresh_streams, publish

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.config import Settings
from llmgw.errors import ProjectionError
from llmgw.fleet import status as status_report
from llmgw.fleet.fold import encode_state
from llmgw.fleet.replay import replay
from llmgw.projections.runner import (
    COMMITS_IN_FLIGHT,
    GC_THRESHOLDS,
    Projector,
    fewer_gc_passes,
)
from llmgw.projections.store import TABLES, Batch, Store

LLMGW = str(Path(sys.executable).with_name("llmgw"))


def tables(path: Path) -> dict[str, list[Any]]:
    store = Store(path)
    try:
        return {name: store.table_rows(name) for name in TABLES}
    finally:
        store.close()


async def project_once(bus: Bus, path: Path, commit_every: int = 100_000) -> None:
    store = Store(path)
    try:
        await Projector(bus, store, commit_every=commit_every).run_once()
    finally:
        store.close()


async def crash_then_resume(settings: Settings, bus: Bus, path: Path, crash_at: str, commit_every: int) -> int:
    """Run `llmgw project --once` in a child that SIGKILLs itself at ``crash_at``, then finish here."""
    env = {**os.environ, "LLMGW_NATS_URL": settings.nats_url}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__).with_name("crashing_projector.py")), crash_at, "--once", "--db", str(path), "--commit-every", str(commit_every),
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    rc = proc.returncode
    assert rc in (-signal.SIGKILL, 0), err.decode()
    await project_once(bus, path, commit_every)
    return rc or 0


async def test_once_writes_history_views_checkpoint_and_keeps_bad_events(bus: Bus, duckdb_path: Path) -> None:
    events: list[m.Event | bytes] = [*small_fleet()[:8], BAD, *small_fleet()[8:]]
    last = await publish(bus, events)
    await project_once(bus, duckdb_path, commit_every=5)
    rows = tables(duckdb_path)
    assert dict(rows["positions"]) == last
    assert len(rows["events"]) == len(small_fleet())
    assert [(r[0], r[2], r[3]) for r in rows["unprojected_events"]] == [
        (subjects.STREAM_FLEET, subjects.fleet("n1", "inventory"), BAD)]
    assert [(r[3], r[4], r[6]) for r in rows["gpu_health"]] == [("n1", 2, False)]
    assert sorted((r[0], r[4]) for r in rows["replicas"]) == [("r-gemma", 1), ("r-llama", 8), ("r-qwen", 1)]
    assert [r[0] for r in rows["unplaceable"]] == ["deepseek-v3"]
    assert len(rows["gpus"]) == 18
    # idle history: a row when a router's entry for a replica changes; the restarted rt-b forgets r-qwen
    assert sorted(((r[3], r[4], r[5], r[6], r[8]) for r in rows["idle_history"]), key=repr) == [
        ("rt-a", 1, "r-llama", t(9), 60.0),
        ("rt-a", 1, "r-qwen", t(7), 180.0),
        ("rt-a", 2, "r-llama", t(95), 300.0),
        ("rt-b", 1, "r-qwen", None, None),
        ("rt-b", 1, "r-qwen", t(8), 120.0),
    ]
    state = Store(duckdb_path)
    try:
        cp = state.load()
        assert status_report.report(cp.state, cursor=cp.cursor).unprojected_events == 1
    finally:
        state.close()


async def test_second_once_run_adds_only_new_events(bus: Bus, duckdb_path: Path) -> None:
    first = await publish(bus, small_fleet()[:10])
    await project_once(bus, duckdb_path)
    assert dict(tables(duckdb_path)["positions"]) == first
    last = {**first, **await publish(bus, small_fleet()[10:])}
    await project_once(bus, duckdb_path)
    rows = tables(duckdb_path)
    assert dict(rows["positions"]) == last
    assert sorted(r[1] for r in rows["events"] if r[0] == subjects.STREAM_CONTROL) == list(range(1, last[subjects.STREAM_CONTROL] + 1))


async def _caught_up(projector: Projector, last: dict[str, int]) -> None:
    for _ in range(400):  # bounded: 20 s
        if all(projector.cursor.positions.get(k, 0) >= v for k, v in last.items()):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"projector at {projector.cursor.positions}, streams at {last}")


async def _live_status(bus: Bus, path: Path, last: dict[str, int], snapshot: Path | None = None) -> bytes:
    store = Store(path)
    projector = Projector(bus, store, commit_interval_s=0.05, copy_path=snapshot, copy_interval_s=0)
    task = asyncio.create_task(projector.run_forever())
    try:
        await _caught_up(projector, last)
        req = m.encode(m.StatusRequest(idle_threshold_s=600))
        return await bus.request(subjects.STATUS, req, service="projector")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        store.close()


async def test_live_replay_and_resumed_status_are_identical(
    bus: Bus, settings: Settings, tmp_path: Path
) -> None:
    last = await publish(bus, [*small_fleet(), BAD])
    live = await _live_status(bus, tmp_path / "live.duckdb", last)
    c = await replay(bus)
    replayed = m.encode(status_report.report(c.state, None, 600, c.cursor, history=c.history))
    rc = await crash_then_resume(settings, bus, tmp_path / "crashed.duckdb", "9", 4)
    assert rc == -signal.SIGKILL
    resumed = await _live_status(bus, tmp_path / "crashed.duckdb", last)
    assert live == replayed == resumed
    report = m.STATUS_REPORT_DECODER.decode(live)
    assert (report.unprojected_events, report.positions) == (1, last)
    assert tables(tmp_path / "crashed.duckdb") == tables(tmp_path / "live.duckdb")


async def test_analyst_can_read_the_snapshot_while_the_projector_runs(bus: Bus, tmp_path: Path) -> None:
    last = await publish(bus, small_fleet())
    snapshot = tmp_path / "llmgw.analysts.duckdb"
    store = Store(tmp_path / "llmgw.duckdb")
    projector = Projector(bus, store, commit_interval_s=0.05, copy_path=snapshot, copy_interval_s=0)
    task = asyncio.create_task(projector.run_forever())
    try:
        await _caught_up(projector, last)
        for _ in range(200):  # bounded: 10 s
            if snapshot.exists() and projector.committed == sum(last.values()):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # one more snapshot after the last commit
        con = duckdb.connect(str(snapshot), read_only=True)
        try:
            n = con.execute("SELECT count(*) FROM events").fetchone()
            idle = con.execute("SELECT replica_id FROM replicas WHERE idle_since IS NULL").fetchall()
        finally:
            con.close()
        assert not task.done()
        assert n == (len(small_fleet()),)
        assert idle == [("r-gemma",)]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        store.close()


async def test_projector_refuses_a_file_another_process_holds(bus: Bus, tmp_path: Path) -> None:
    path = tmp_path / "held.duckdb"
    code = f"import duckdb, time; c = duckdb.connect({str(path)!r}); print('ok', flush=True); time.sleep(30)"
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), timeout=20) == b"ok\n"
        with pytest.raises(Exception, match="another projector may hold it"):
            Store(path)
    finally:
        proc.kill()
        await proc.wait()


# --- property: crash anywhere, resume, and the rows are those of a clean replay ---------------

@hsettings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=event_lists, crash=st.data(), commit_every=st.integers(1, 6), on_loop=st.booleans())
async def test_crash_anywhere_then_resume_equals_clean_replay(
    bus: Bus, settings: Settings, tmp_path: Path, events: list[m.Event | bytes], crash: st.DataObject,
    commit_every: int, on_loop: bool,
) -> None:
    await fresh_streams(bus)
    await publish(bus, events)
    at = crash.draw(st.integers(1, len(events)), label="crash at event")
    name = f"{abs(hash((repr(events), at, commit_every, on_loop)))}"
    clean, crashed = tmp_path / f"clean-{name}.duckdb", tmp_path / f"crashed-{name}.duckdb"
    for path in (clean, crashed):  # hypothesis replays an example under the same name, on new streams
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".wal").unlink(missing_ok=True)
    await project_once(bus, clean)
    rc = await crash_then_resume(settings, bus, crashed, f"{at}:fold" if on_loop else str(at), commit_every)
    assert rc == -signal.SIGKILL  # every crash point lies inside the history
    assert tables(crashed) == tables(clean)
    clean_store = Store(clean)
    try:
        cp = clean_store.load()
        expected = msgspec.json.encode(status_report.report(cp.state, cursor=cp.cursor))
    finally:
        clean_store.close()
    c = await replay(bus)
    assert expected == m.encode(status_report.report(c.state, cursor=c.cursor))


async def test_cancelled_while_commits_are_queued_loses_no_rows(bus: Bus, tmp_path: Path) -> None:
    """Stopping a projector while the writer still holds queued commits: they all land, in order,
    so a resumed projector ends with the rows of a clean replay (none skipped past)."""
    await fresh_streams(bus)
    await publish(bus, [random_event(i % 8, i, i * 7 % 8, i * 3 % 8) for i in range(240)])
    clean, cancelled = tmp_path / "clean.duckdb", tmp_path / "cancelled.duckdb"
    await project_once(bus, clean)
    store = Store(cancelled)
    projector = Projector(bus, store, commit_every=3, batch=4)
    task = asyncio.create_task(projector.run_forever(serve_status=False))
    try:
        for _ in range(400):  # bounded: 20 s
            if len(projector._inflight) >= COMMITS_IN_FLIGHT:
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError("the writer never had two commits queued")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        store.close()
    partial = tables(cancelled)
    assert 0 < len(partial["events"]) < len(tables(clean)["events"])  # stopped midway, after some commits
    await project_once(bus, cancelled)
    assert tables(cancelled) == tables(clean)


async def test_a_stream_declared_again_is_refused_not_read_past(bus: Bus, tmp_path: Path) -> None:
    """A stream deleted and declared again restarts at sequence 1: reading on from the old
    checkpoint would skip its events with no error. The projector stops and says what to do."""
    await fresh_streams(bus)
    await publish(bus, small_fleet()[:6])
    path = tmp_path / "old.duckdb"
    await project_once(bus, path)
    await fresh_streams(bus)
    await publish(bus, small_fleet())  # the new streams already reach past the old checkpoint
    with pytest.raises(ProjectionError, match=r"LLMGW_\w+ is not the stream .*old.duckdb is projected from: "
                                              r"it was created at .*Move the file away"):
        await project_once(bus, path)
    # A file from before streams were told apart (no creation times) is caught by its positions.
    store = Store(path)
    try:
        cp = store.load()
        cp.cursor.stream_created.clear()
        store.commit(Batch(), encode_state(cp.state, cp.cursor))
    finally:
        store.close()
    await fresh_streams(bus)
    await publish(bus, small_fleet()[:2])
    with pytest.raises(ProjectionError, match=r"messages are folded here, but it ends at sequence"):
        await project_once(bus, path)
    fresh = tmp_path / "new.duckdb"
    await project_once(bus, fresh)  # the next step the error gives: a new file
    assert dict(tables(fresh)["positions"]) == {k: v for k, v in (await _heads(bus)).items() if v}


async def _heads(bus: Bus) -> dict[str, int]:
    return {s: await bus.stream_last_seq(s) for s in subjects.HISTORY_STREAMS}


async def test_a_projector_folds_with_fewer_collector_passes(bus: Bus) -> None:
    await publish(bus, small_fleet())
    seen: set[tuple[int, ...]] = set()
    await Projector(bus, None, progress=lambda done, total: seen.add(gc.get_threshold())).run_once()
    assert seen == {GC_THRESHOLDS}
    assert gc.get_threshold() != GC_THRESHOLDS


def test_collector_thresholds_are_raised_while_folding_and_restored_after_the_last() -> None:
    before = gc.get_threshold()
    with fewer_gc_passes():
        with fewer_gc_passes():  # two projectors in one process
            assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.get_threshold() == GC_THRESHOLDS
    assert gc.get_threshold() == before != GC_THRESHOLDS


async def test_a_status_request_waits_for_what_the_asker_saw_stored(bus: Bus, tmp_path: Path) -> None:
    last = await publish(bus, small_fleet())
    store = Store(tmp_path / "live.duckdb")
    projector = Projector(bus, store, commit_interval_s=0.05)
    task = asyncio.create_task(projector.run_forever(serve_status=False))
    try:
        fleet = subjects.STREAM_FLEET
        # The asker saw 50 more fleet events stored than the projector has folded yet.
        ask = m.StatusRequest(wait_for={fleet: last[fleet] + 50, "NO_SUCH_STREAM": 10**9}, wait_s=20)
        answer = asyncio.create_task(projector.handle_status(m.encode(ask)))
        await asyncio.sleep(0.3)
        assert not answer.done()  # it waits for them, it does not answer from an older fold
        flips = [m.GpuHealthChanged(at=t(100 + i), node="n1", gpu_index=0, gpu_uuid="GPU-n1-0", healthy=i % 2 == 1)
                 for i in range(50)]
        await publish(bus, flips)
        report = m.STATUS_REPORT_DECODER.decode(await asyncio.wait_for(answer, 20))
        assert report.positions[fleet] >= last[fleet] + 50
        # Never stored: past the wait, an error that names the lag, not an old answer.
        with pytest.raises(ProjectionError, match=r"LLMGW_FLEET \d+ of \d+\) after 0.2s; it is catching up"):
            await projector.handle_status(m.encode(m.StatusRequest(wait_for={fleet: 10**9}, wait_s=0.2)))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        store.close()


async def test_a_checkpoint_from_an_older_fold_version_gets_its_history_and_memory_folded_once(
    bus: Bus, tmp_path: Path,
) -> None:
    """An upgraded projector's checkpoint has no ModelHistory and no scheduler or planner memory:
    it folds them once up to its cursor, then as it goes, and ends where a fold from sequence 1 does
    (what its fold snapshots then carry to every service)."""
    await fresh_streams(bus)
    events = small_fleet()
    await publish(bus, events[:13])  # two replicas placed
    path = tmp_path / "old.duckdb"
    await project_once(bus, path)
    store = Store(path)
    try:
        cp = store.load()
        assert cp.complete() and cp.history.position > 0 and cp.demand.placed  # noted while folding
        store.commit(Batch(), msgspec.msgpack.encode({"state": cp.state, "cursor": cp.cursor}))  # as version 1 wrote it
        old = store.load()
        assert not old.complete() and old.history.position == 0 and not old.demand.placed
    finally:
        store.close()
    await publish(bus, events[13:])
    store = Store(path)
    try:
        resumed = await Projector(bus, store).run_once()
    finally:
        store.close()
    again = await replay(bus, use_snapshots=False)
    assert (resumed.history, resumed.demand, resumed.observed) == (again.history, again.demand, again.observed)
    assert (resumed.pool, resumed.lost_at_seq) == (again.pool, again.lost_at_seq)  # every service's memory
    assert resumed.history.recent and resumed.demand.placed  # not trivially equal
    assert resumed.pool.replicas and resumed.lost_at_seq
