"""The DuckDB store on real files: one transaction per commit, resume state, the analysts' copy, bad input."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import duckdb
import pytest
from projection_events import small_fleet, t

from llmgw import messages as m
from llmgw import subjects
from llmgw.errors import ProjectionError
from llmgw.fleet.fold import Checkpoint, encode_state
from llmgw.fleet.state import Cursor, FleetState, apply
from llmgw.projections.store import Batch, Store, add_event_rows, add_unprojected

TS_NS = 1_772_445_600_000_000_000  # when "NATS stored" the messages below


def batch_of(events: list[m.Event], cp: Checkpoint, start: int = 1) -> Batch:
    """Rows for events as the projector makes them (one stream per event kind, like NATS)."""
    state, batch = cp.state, Batch()
    for i, e in enumerate(events, start):
        subject = subjects.subject_for(e)
        stream = subjects.stream_for_subject(subject)
        prev = state.routers.get(e.router) if isinstance(e, m.IdleMapPublished) else None
        add_event_rows(batch, stream, i, subject, m.encode(e), TS_NS, e, prev)
        apply(state, e)
        cp.cursor.positions[stream] = i
    return batch


def test_commit_writes_history_views_and_checkpoint(duckdb_path: Path) -> None:
    store = Store(duckdb_path)
    cp = Checkpoint()
    batch = batch_of(small_fleet(), cp)
    add_unprojected(batch, subjects.STREAM_FLEET, 99, "llmgw.fleet.x.health", b"\xff not json", "bad")
    cp.cursor.unprojected = 1
    store.commit(batch, encode_state(cp.state, cp.cursor))
    assert store.load() == cp
    assert store.query("SELECT count(*) FROM events") == [(len(small_fleet()),)]
    assert store.query("SELECT raw, error FROM unprojected_events") == [(b"\xff not json", "bad")]
    assert store.query("SELECT events, unprojected FROM projector_state") == [(len(small_fleet()) + 1, 1)]
    row = store.query("SELECT type, ts, node, model, replica_id FROM events WHERE type = 'ReplicaPlaced' "
                      "AND replica_id = 'r-llama'")
    assert row == [("ReplicaPlaced", t(4), "n2", "llama-70b", "r-llama")]
    assert store.query("SELECT DISTINCT stored_at FROM events") == [(datetime(2026, 3, 2, 10, 0, tzinfo=UTC),)]
    assert store.query("SELECT json IS NULL, count(*) FROM events GROUP BY ALL ORDER BY 1") == [(False, 19), (True, 4)]
    # An idle map is recorded under its own type, without a payload (idle_history holds what changed).
    assert store.query("SELECT DISTINCT type FROM events WHERE json IS NULL") == [("IdleMapPublished",)]
    # A placement from before GPUs were shared (no MiB on its GpuRef) books the whole card.
    assert store.query("SELECT node, gpu_index, replica_ids, booked_mib FROM gpus WHERE len(replica_ids) > 0 "
                       "AND node = 'n1'") == [("n1", 0, ["r-qwen"], 81559)]
    assert store.query("SELECT model, replicas_wanted, replicas_placed FROM models ORDER BY model") == [
        ("deepseek-v3", 1, 0), ("gemma-9b", 1, 1), ("llama-70b", 1, 1), ("qwen-8b", 1, 1)]
    assert store.query("SELECT node, lost FROM nodes WHERE lost") == [("n5", True)]
    store.close()


def test_idle_history_keeps_microseconds_and_offsets_exactly(duckdb_path: Path) -> None:
    """DuckDB parses the changed entries' times itself: the same instants, and idle_s as Python computes it."""
    at = datetime(2026, 3, 2, 10, 0, 0, 250_000, tzinfo=UTC)
    plus2 = timezone(timedelta(hours=2))
    last = datetime(2026, 3, 2, 11, 58, 59, 123_457, tzinfo=plus2)  # 09:58:59.123457 UTC
    since = datetime(2026, 3, 2, 9, 0, 0, 1, tzinfo=UTC)
    maps = [
        m.IdleMapPublished(at=at, router="rt", boot_id="b1", tick=1, last_request={"r1": last},
                           serving_since={"r2": since}),
        m.IdleMapPublished(at=at + timedelta(seconds=10), router="rt", boot_id="b1", tick=2,
                           last_request={"r1": last}, serving_since={"r2": since}),  # unchanged: no rows
        m.IdleMapPublished(at=at + timedelta(seconds=20), router="rt", boot_id="b1", tick=3,
                           last_request={"r1": last}),  # r2 vanished
    ]
    store = Store(duckdb_path)
    store.commit(batch_of(maps, Checkpoint()), encode_state(FleetState(), Cursor()))
    assert store.query("SELECT tick, replica_id, last_request, serving_since, idle_s FROM idle_history "
                       "ORDER BY tick, replica_id") == [
        (1, "r1", last, None, (at - last).total_seconds()),
        (1, "r2", None, since, (at - since).total_seconds()),
        (3, "r2", None, None, None),  # vanished: unknown, not idle
    ]
    store.close()


def test_a_failed_commit_writes_nothing(duckdb_path: Path) -> None:
    store = Store(duckdb_path)
    cp = Checkpoint()
    events = small_fleet()
    store.commit(batch_of(events[:5], cp), encode_state(cp.state, cp.cursor))
    before = {name: store.table_rows(name) for name in ("events", "positions", "projector_state", "nodes")}

    def boom() -> None:
        raise duckdb.IOException("disk full")

    with pytest.raises(ProjectionError, match="nothing of this batch was written"):
        store.commit(batch_of(events[5:], cp, start=6), encode_state(cp.state, cp.cursor), before_commit=boom)
    assert {name: store.table_rows(name) for name in before} == before
    store.close()


def test_reopened_file_resumes_from_its_state(duckdb_path: Path) -> None:
    store = Store(duckdb_path)
    cp = Checkpoint()
    store.commit(batch_of(small_fleet()[:9], cp), encode_state(cp.state, cp.cursor))
    store.close()
    again = Store(duckdb_path)
    assert again.load() == cp
    again.close()


def test_a_newer_schema_is_refused_with_the_next_step(duckdb_path: Path) -> None:
    store = Store(duckdb_path)
    cp = Checkpoint()
    store.commit(batch_of(small_fleet()[:2], cp), encode_state(cp.state, cp.cursor))
    store.query("UPDATE projector_state SET schema_version = 99")
    with pytest.raises(ProjectionError, match="project into a new file"):
        store.load()
    store.close()


def test_snapshot_is_a_complete_read_only_copy(tmp_path: Path) -> None:
    store = Store(tmp_path / "live.duckdb")
    cp = Checkpoint()
    store.commit(batch_of(small_fleet(), cp), encode_state(cp.state, cp.cursor))
    snap = store.export_copy(tmp_path / "live.analysts.duckdb")
    store.export_copy(snap)  # replacing an existing snapshot works too
    assert not (tmp_path / "live.analysts.duckdb.tmp").exists()
    con = duckdb.connect(str(snap), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM events").fetchone() == (len(small_fleet()),)
        assert con.execute("SELECT count(*) FROM idle_history").fetchone() == (5,)
    finally:
        con.close()
    store.close()


def test_a_plain_copy_of_the_live_file_holds_what_was_committed(tmp_path: Path) -> None:
    """Checkpointed on a schedule, the file itself has the commits, not only its WAL (which a copy leaves behind)."""
    live = tmp_path / "live.duckdb"
    store = Store(live, flush_interval_s=0)  # at every commit, as a long-running one does every minute
    cp = Checkpoint()
    store.commit(batch_of(small_fleet(), cp), encode_state(cp.state, cp.cursor))
    shutil.copyfile(live, tmp_path / "copy.duckdb")  # while the projector holds it, without the WAL
    con = duckdb.connect(str(tmp_path / "copy.duckdb"), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM events").fetchone() == (len(small_fleet()),)
    finally:
        con.close()
        store.close()


def test_an_old_schema_file_is_refused_before_anything_is_created_in_it(tmp_path: Path) -> None:
    """Schema 3's tables lack the columns the views read: the next step, not a binder error."""
    old = tmp_path / "old.duckdb"
    con = duckdb.connect(str(old))
    con.execute("CREATE TABLE projector_state (id INTEGER PRIMARY KEY, schema_version INTEGER, as_of TIMESTAMPTZ, "
                "events BIGINT, unprojected BIGINT, snapshot BLOB)")
    con.execute("CREATE TABLE nodes (name VARCHAR, gpus INTEGER)")
    con.execute("INSERT INTO projector_state VALUES (1, 3, NULL, 0, 0, NULL)")
    con.close()
    with pytest.raises(ProjectionError, match=r"written by projector schema 3, this is 7; project into a new file"):
        Store(old)
    con = duckdb.connect(str(old), read_only=True)  # closed again, and untouched
    try:
        assert con.execute("SELECT count(*) FROM duckdb_views() WHERE NOT internal").fetchone() == (0,)
    finally:
        con.close()


def _as_schema_6(con: duckdb.DuckDBPyConnection) -> None:
    """Make a file look as schema 6 left it: usage_by_key without its 429s and 403s."""
    con.execute("ALTER TABLE usage_by_key DROP COLUMN throttled")
    con.execute("ALTER TABLE usage_by_key DROP COLUMN forbidden")
    con.execute("UPDATE projector_state SET schema_version = 6")


def _as_schema_5(con: duckdb.DuckDBPyConnection) -> None:
    """Make a file look as schema 5 left it: no bookings' history, one holder per GPU as text."""
    _as_schema_6(con)
    con.execute("DROP TABLE gpu_bookings")
    con.execute("DROP TABLE replica_memory")
    con.execute("ALTER TABLE gpus ADD COLUMN replica_id VARCHAR")
    con.execute("UPDATE gpus SET replica_id = nullif(array_to_string(replica_ids, ', '), '')")
    con.execute("ALTER TABLE gpus DROP COLUMN replica_ids")
    con.execute("ALTER TABLE gpus DROP COLUMN booked_mib")
    con.execute("UPDATE projector_state SET schema_version = 5")


def test_a_schema_4_file_is_renamed_in_place_and_resumes(duckdb_path: Path) -> None:
    """Schema 5 renamed two names and added two columns, filled in from the rows: no rebuild."""
    store = Store(duckdb_path)
    cp = Checkpoint()
    stopped = m.ReplicaStopped(at=t(50), replica_id="r-qwen", model="qwen-8b", reason="scaled down to 0")
    store.commit(batch_of([*small_fleet(), stopped], cp), encode_state(cp.state, cp.cursor))
    events = store.query("SELECT count(*) FROM events")
    bookings = store.table_rows("gpu_bookings")
    _as_schema_5(store.con)
    store.con.execute("ALTER TABLE positions RENAME TO checkpoint")  # the file as schema 4 left it
    store.con.execute("ALTER TABLE projector_state RENAME COLUMN checkpoint TO snapshot")
    store.con.execute("ALTER TABLE gpu_health DROP COLUMN xid")
    store.con.execute("ALTER TABLE replica_lifecycle DROP COLUMN code")
    store.con.execute("UPDATE projector_state SET schema_version = 4")
    store.close()
    again = Store(duckdb_path)
    try:
        assert again.load() == cp
        assert again.query("SELECT schema_version FROM projector_state") == [(7,)]  # through 5 and 6, to 7
        assert again.query("SELECT count(*) FROM events") == events
        assert again.table_rows("gpu_bookings") == bookings
        assert again.query("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'checkpoint'") == [(0,)]
        # The new columns, filled in for the rows already there: the XID number, the stop's code.
        assert again.query("SELECT node, gpu_index, xid FROM gpu_health") == [("n1", 2, 79)]
        assert again.query("SELECT replica_id, code FROM replica_lifecycle WHERE kind = 'stopped'") == [
            ("r-qwen", "scaled_down")]
    finally:
        again.close()


def test_unknown_table_is_an_error(duckdb_path: Path) -> None:
    store = Store(duckdb_path)
    with pytest.raises(ProjectionError, match="no table 'nope'"):
        store.table_rows("nope")
    store.close()


def test_payloads_with_line_breaks_and_odd_text_land_one_row_each(duckdb_path: Path) -> None:
    """A batch's payloads reach DuckDB as one string: JSON from another publisher
    may break lines between tokens, and strings may hold commas, quotes and
    escaped newlines; every event must still be exactly one row, kept as published."""
    store = Store(duckdb_path)
    cp = Checkpoint()
    batch = Batch()
    # Comma, quotes, and a newline inside a string (free text: names may hold none of them).
    lost = m.ReplicaStopped(at=t(1), replica_id="r1", model="m", reason='n1,"x"\nq')
    pretty = b'{\n  "type": "NodeLost",\r\n  "at": "2026-03-02T10:00:02Z",\n  "node": "n2"\n}'
    events = [(lost, m.encode(lost)), (m.decode_event(pretty), pretty)]
    for seq, (event, data) in enumerate(events, 1):
        add_event_rows(batch, subjects.STREAM_FLEET, seq, subjects.fleet("n", "lost"), data, TS_NS, event)
        apply(cp.state, event)
    cp.cursor.positions[subjects.STREAM_FLEET] = 2
    store.commit(batch, encode_state(cp.state, cp.cursor))
    rows = store.query("SELECT seq, coalesce(node, replica_id), ts, json FROM events ORDER BY seq")
    assert [(r[0], r[1], r[2]) for r in rows] == [(1, "r1", t(1)), (2, "n2", datetime(2026, 3, 2, 10, 0, 2, tzinfo=UTC))]
    assert store.query("SELECT detail FROM replica_lifecycle") == [('n1,"x"\nq',)]
    assert m.decode_event(rows[0][3].encode()) == lost
    assert rows[1][3].encode() == pretty
    store.close()


def test_the_paths_the_store_reads_are_fields_of_the_schema() -> None:
    """The JSON paths come from messages.py's field names: a renamed field fails at import, not in a query."""
    from llmgw.projections.store import _json_path

    assert _json_path("spec", "name") == "$.spec.name"
    with pytest.raises(AssertionError, match="no event in llmgw.messages has a field 'replica'"):
        _json_path("replica")
    with pytest.raises(AssertionError, match="'nope'"):
        _json_path("spec", "nope")


def test_the_engines_cached_share_reaches_the_fold_and_prefix_cache(duckdb_path: Path) -> None:
    """A router's map carries each replica's prompt and cached tokens: summed in the fold, a row per tick."""
    maps = [m.IdleMapPublished(at=t(200), router="rt-a", boot_id="a1", tick=3,
                               cache_use={"r-qwen": m.CacheUse("qwen-8b", 1000, 800)}),
            m.IdleMapPublished(at=t(201), router="rt-b", boot_id="b2", tick=2,
                               cache_use={"r-qwen": m.CacheUse("qwen-8b", 500, 100),
                                          "r-gone": m.CacheUse("qwen-8b", 9, 9)}),  # never placed: no fold, a row
            m.IdleMapPublished(at=t(202), router="rt-a", boot_id="a1", tick=4)]
    store = Store(duckdb_path)
    cp = Checkpoint()
    store.commit(batch_of(small_fleet() + maps, cp), encode_state(cp.state, cp.cursor))
    qwen = cp.state.replicas["r-qwen"]
    assert (qwen.prompt_tokens, qwen.cached_tokens) == (1500, 900)
    assert store.query("SELECT router, replica_id, model, prompt_tokens, cached_tokens FROM prefix_cache "
                       "ORDER BY seq, replica_id") == [("rt-a", "r-qwen", "qwen-8b", 1000, 800),
                                                       ("rt-b", "r-gone", "qwen-8b", 9, 9),
                                                       ("rt-b", "r-qwen", "qwen-8b", 500, 100)]
    assert store.query("SELECT prompt_tokens, cached_tokens, round(cached_share, 3) FROM prefix_cache_daily "
                       "WHERE replica_id = 'r-qwen'") == [(1500, 900, 0.6)]
    store.close()


def test_stops_carry_their_code_and_faults_their_xid(duckdb_path: Path) -> None:
    """Analysts group stops by code and faults by XID number, without a regular expression."""
    store = Store(duckdb_path)
    cp = Checkpoint()
    events = [*small_fleet(),
              m.GpuHealthChanged(at=t(40), node="n2", gpu_index=1, gpu_uuid="GPU-n2-1", healthy=False,
                                 reasons=("thermal slowdown", "xid 48: double-bit ECC error")),
              m.ReplicaStopped(at=t(50), replica_id="r-qwen", model="qwen-8b", reason="nobody asked", code="idle"),
              m.ReplicaStopped(at=t(51), replica_id="r-gemma", model="gemma-9b", reason="failed: CUDA out of memory")]
    store.commit(batch_of(events, cp), encode_state(cp.state, cp.cursor))
    assert store.query("SELECT node, xid FROM gpu_health ORDER BY seq") == [("n1", 79), ("n2", 48)]
    assert store.query("SELECT replica_id, code FROM replica_lifecycle WHERE kind = 'stopped' ORDER BY seq") == [
        ("r-qwen", "idle"), ("r-gemma", "engine_failed")]  # the second written before codes: its wording's
    store.close()


def s(tenths: int) -> datetime:
    """A moment in tenths of a minute after the fleet's start: within the 5 minutes the store keeps event times
    for (TS_NS is when these were stored)."""
    return t(tenths / 10)


def _shared() -> list[m.Event]:
    """Two small replicas on one card, a whole one from before sharing, what their engines held, their stops."""
    small = m.ModelSpec(name="a", source="./a.gguf", precision="q4_K_M", engine="llama.cpp", gpu_class="H100-80GB",
                        context=4096, gib_per_gpu=10.0)

    def placed(rid: str, index: int, mib: int, at: datetime) -> m.ReplicaPlaced:
        return m.ReplicaPlaced(at=at, replica_id=rid, model=rid[:-3], nodes=("n1",), spec=small, fabric="ib-a",
                               gpus=(m.GpuRef(node="n1", index=index, uuid=f"GPU-n1-{index}", mib=mib),))

    def healthy(rid: str, used: int, at: datetime) -> m.ReplicaStateChanged:
        return m.ReplicaStateChanged(at=at, replica_id=rid, model=rid[:-3], node="n1", state="healthy",
                                     endpoint="http://n1:8000", observed_memory_mib=used)

    return [
        small_fleet()[0],  # n1: four 81559 MiB cards
        placed("a-r1", 0, 10240, s(1)),
        placed("b-r1", 0, 20480, s(2)),
        placed("old-r1", 1, 0, s(3)),  # mib 0: the whole card
        healthy("a-r1", 9000, s(4)),
        healthy("b-r1", 0, s(4)),  # not measured: no row
        m.ReplicaOverBooked(at=s(5), replica_id="b-r1", model="b", node="n1", booked_mib=20480, used_mib=23000),
        # the next commit
        m.ReplicaStopped(at=s(6), replica_id="a-r1", model="a", reason="idle", code="idle"),
        m.ReplicaStopped(at=s(7), replica_id="a-r1", model="a", reason="requested", code="requested"),  # again
        m.ReplicaStopped(at=s(8), replica_id="b-r1", model="b", reason="idle", code="idle"),
    ]


def test_bookings_say_who_booked_how_much_of_each_gpu_and_what_their_engines_held(duckdb_path: Path) -> None:
    store = Store(duckdb_path)
    cp = Checkpoint()
    events = _shared()
    try:
        store.commit(batch_of(events[:7], cp), encode_state(cp.state, cp.cursor))
        assert store.query("SELECT gpu_index, replica_ids, booked_mib FROM gpus WHERE node = 'n1' ORDER BY 1") == [
            (0, ["a-r1", "b-r1"], 30720), (1, ["old-r1"], 81559), (2, [], 0), (3, [], 0)]
        # A stop in a later commit than its placement frees what the placement booked, once.
        store.commit(batch_of(events[7:], cp, start=8), encode_state(cp.state, cp.cursor))
        assert store.query("SELECT ts, gpu_index, replica_id, event, booked_mib, memory_mib FROM gpu_bookings "
                           "ORDER BY seq") == [
            (s(1), 0, "a-r1", "placed", 10240, 81559), (s(2), 0, "b-r1", "placed", 20480, 81559),
            (s(3), 1, "old-r1", "placed", 81559, 81559),
            (s(6), 0, "a-r1", "stopped", 10240, 81559), (s(8), 0, "b-r1", "stopped", 20480, 81559)]
        assert store.query("SELECT ts, replica_id, node, used_mib, kind FROM replica_memory ORDER BY seq") == [
            (s(4), "a-r1", "n1", 9000, "state"), (s(5), "b-r1", "n1", 23000, "overbooked")]
        assert store.query("SELECT gpu_index, replica_ids, booked_mib FROM gpus WHERE node = 'n1' AND booked_mib > 0") \
            == [(1, ["old-r1"], 81559)]
        # Booked against used per GPU over time, each stretch to the next (the last to the newest event).
        rows = store.query("SELECT gpu_index, ts, until, span_s, memory_mib, booked_mib, used_mib, replica_ids, "
                           "unmeasured FROM gpu_booked_used ORDER BY gpu_index, ts")
        assert rows == [
            (0, s(1), s(2), 6.0, 81559, 10240, None, ["a-r1"], 1),
            (0, s(2), s(4), 12.0, 81559, 30720, None, ["a-r1", "b-r1"], 2),
            (0, s(4), s(5), 6.0, 81559, 30720, 9000, ["a-r1", "b-r1"], 1),
            (0, s(5), s(6), 6.0, 81559, 30720, 32000, ["a-r1", "b-r1"], 0),  # b past its booking
            (0, s(6), s(8), 12.0, 81559, 20480, 23000, ["b-r1"], 0),
            (0, s(8), s(8), 0.0, 81559, 0, None, [], 0),
            (1, s(3), s(8), 30.0, 81559, 81559, None, ["old-r1"], 1),
        ]
    finally:
        store.close()


def test_a_schema_5_file_gets_its_bookings_from_the_events_it_holds(duckdb_path: Path) -> None:
    """Schema 6's history tables are filled in place from the events: the rows a fresh projection writes."""
    store = Store(duckdb_path)
    cp = Checkpoint()
    events = _shared()
    store.commit(batch_of(events[:7], cp), encode_state(cp.state, cp.cursor))
    store.commit(batch_of(events[7:], cp, start=8), encode_state(cp.state, cp.cursor))
    fresh = {table: store.table_rows(table) for table in ("gpu_bookings", "replica_memory", "gpus")}
    _as_schema_5(store.con)
    assert store.query("SELECT replica_id FROM gpus WHERE replica_id IS NOT NULL") == [("old-r1",)]
    store.close()
    again = Store(duckdb_path)
    try:
        assert again.query("SELECT schema_version FROM projector_state") == [(7,)]
        assert {table: again.table_rows(table) for table in fresh} == fresh
        assert again.load() == cp
    finally:
        again.close()


def test_a_schema_6_file_keeps_its_usage_and_knows_its_429s_and_403s_from_then_on(duckdb_path: Path) -> None:
    """Schema 7 counts 429s and 403s apart; the rows a schema-6 file held say unknown (NULL), not 0."""
    use = {"ka": {"m1": m.KeyUse(requests=4, errors=3, throttled=2, forbidden=1, prompt_tokens=10)}}
    maps = [m.IdleMapPublished(at=t(i), router="rt", boot_id="b", tick=i, callers=use) for i in (1, 2)]
    store = Store(duckdb_path)
    cp = Checkpoint()
    store.commit(batch_of(maps[:1], cp), encode_state(cp.state, cp.cursor))
    _as_schema_6(store.con)
    store.close()
    again = Store(duckdb_path)
    try:
        assert again.query("SELECT schema_version FROM projector_state") == [(7,)]
        again.commit(batch_of(maps[1:], cp, start=2), encode_state(cp.state, cp.cursor))
        assert again.query("SELECT seq, requests, errors, throttled, forbidden FROM usage_by_key ORDER BY seq") == [
            (1, 4, 3, None, None), (2, 4, 3, 2, 1)]
        assert again.query("SELECT requests, errors, throttled, forbidden FROM usage_by_key_daily") == [(8, 6, 2, 1)]
    finally:
        again.close()
