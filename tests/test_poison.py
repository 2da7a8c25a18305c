"""One bad event must not stop a projection: bounds at the decoder, a store that sets aside what it
cannot write, event times bounded by the stream's own clock, and an unplaceable model cleared by a scale."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
from projection_events import inventory, small_fleet, spec, t

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.fleet import demand
from llmgw.fleet import status as status_report
from llmgw.fleet.fold import Checkpoint, encode_state
from llmgw.fleet.replay import replay
from llmgw.fleet.state import MAX_AHEAD, MAX_BEHIND, FleetState, apply, clamp_times, fold, stored_at
from llmgw.projections.runner import Projector
from llmgw.projections.store import Batch, Store
from llmgw.scheduler import placement as scheduler

AT = "2026-03-02T10:00:00Z"


def _doc(event: m.Event, **change: Any) -> bytes:
    doc = json.loads(m.encode(event))
    doc.update(change)
    return json.dumps(doc).encode()


GPU_2_40 = json.loads(m.encode(inventory("n1", "ib-a", 1, t(0))))
GPU_2_40["gpus"][0]["index"] = 2**40

# Each of these decoded, and then stopped the projector at every restart (or the fold, or the scheduler).
POISON: dict[str, tuple[type[m.Event], bytes]] = {
    "replicas 2**31 (INT32 column)": (m.ModelScaled, _doc(m.ModelScaled(at=t(0), name="m", replicas=1), replicas=2**31)),
    "replicas 2**64 (msgpack checkpoint)": (m.ModelScaled, _doc(m.ModelScaled(at=t(0), name="m", replicas=1), replicas=2**64)),
    "declared replicas 2**31": (m.ModelDeclared, json.dumps({"type": "ModelDeclared", "at": AT, "spec": {
        **json.loads(msgspec.json.encode(spec("m"))), "replicas": 2**31}}).encode()),
    "GPU index 2**40 in an inventory": (m.NodeInventoryReported, json.dumps(GPU_2_40).encode()),
    "GPU index 2**40 in a health change": (m.GpuHealthChanged, _doc(
        m.GpuHealthChanged(at=t(0), node="n1", gpu_index=0, gpu_uuid="GPU-0", healthy=False), gpu_index=2**40)),
    "restarts 2**31": (m.ReplicaStateChanged, _doc(m.ReplicaStateChanged(
        at=t(0), replica_id="m-r1", model="m", node="n1", state="failed"), restarts=2**31)),
    "tp 2**31": (m.ModelDeclared, json.dumps({"type": "ModelDeclared", "at": AT, "spec": {
        **json.loads(msgspec.json.encode(spec("m"))), "tp": 2**31}}).encode()),
    "a model declared with a newline in its name": (m.ModelDeclared, json.dumps({"type": "ModelDeclared", "at": AT, "spec": {
        **json.loads(msgspec.json.encode(spec("m"))), "name": "new\nline"}}).encode()),
    "a node reporting under a name with a space": (m.NodeInventoryReported, _doc(inventory("n1", "ib-a", 1, t(0)), node="a b")),
    "an empty model name": (m.ModelRemoved, _doc(m.ModelRemoved(at=t(0), name="m"), name="")),
    "a node name of 100 000 characters": (m.NodeLost, _doc(m.NodeLost(at=t(0), node="n"), node="n" * 100_000)),
    "a router name with a newline": (m.IdleMapPublished, _doc(m.IdleMapPublished(at=t(0), router="r", boot_id="b", tick=1),
                                                              router="r\n")),
    "a time with no zone (cannot be compared)": (m.NodeLost, _doc(m.NodeLost(at=t(0), node="n1"), at="2026-03-02T10:00:00")),
}


@pytest.mark.parametrize("name", sorted(POISON))
def test_decoders_refuse_values_out_of_bounds(name: str) -> None:
    _, data = POISON[name]
    with pytest.raises(msgspec.ValidationError):
        m.decode_event(data)
    for decoder in (m.FLEET_DECODER, m.CONTROL_DECODER):
        with pytest.raises(msgspec.ValidationError):
            decoder.decode(data)


# Replica ids as idle-map keys: looked up only, bounded by the message (see messages.IdleMapPublished).
UNBOUNDED_KEYS = {"IdleMapPublished.last_request[key]", "IdleMapPublished.serving_since[key]",
                  "IdleMapPublished.busy[key]"}


def _unbounded(t: Any, path: str, seen: set[Any], out: list[str]) -> None:
    """Every int, float and str reachable from ``t`` without both bounds (strings: a max length)."""
    from msgspec import inspect as mi

    if isinstance(t, mi.IntType):
        if t.ge is None and t.gt is None or t.le is None and t.lt is None:
            out.append(f"{path}: int {t}")
        elif (t.le if t.le is not None else t.lt) > 2**63 - 1 or (t.ge if t.ge is not None else t.gt) < -(2**63):
            out.append(f"{path}: int past 64 bits {t}")
    elif isinstance(t, mi.FloatType):
        if t.le is None and t.lt is None:
            out.append(f"{path}: float {t}")
    elif isinstance(t, mi.StrType):
        if t.max_length is None and path not in UNBOUNDED_KEYS:
            out.append(f"{path}: str")
    elif isinstance(t, mi.StructType):
        if t.cls in seen:
            return
        seen.add(t.cls)
        for f in t.fields:
            _unbounded(f.type, f"{t.cls.__name__}.{f.name}", seen, out)
    elif isinstance(t, mi.UnionType):
        for x in t.types:
            _unbounded(x, path, seen, out)
    elif isinstance(t, mi.DictType):
        _unbounded(t.key_type, f"{path}[key]", seen, out)
        _unbounded(t.value_type, f"{path}[value]", seen, out)
    elif isinstance(t, (mi.VarTupleType, mi.ListType)):
        _unbounded(t.item_type, f"{path}[]", seen, out)
    elif isinstance(t, mi.TupleType):
        for x in t.item_types:
            _unbounded(x, f"{path}[]", seen, out)


def test_every_number_and_string_of_every_event_is_bounded() -> None:
    """The rule, for fields added later too: a decoder never hands the fold a value the store cannot hold."""
    from msgspec import inspect as mi

    out: list[str] = []
    _unbounded(mi.type_info(m.AnyEvent), "", set(), out)
    assert out == []


def test_names_follow_one_rule() -> None:
    ok = ["a", "qwen14", "gpu01.dc1", "h100-a-01", "Model_2", "x" * m.NAME_MAX]
    bad = ["", "new\nline", "trailing\n", "-lead", ".hidden", "a b", "ä", "x" * (m.NAME_MAX + 1), "a/b", "a*"]
    dec = msgspec.json.Decoder(m.Name)
    for name in ok:
        assert dec.decode(json.dumps(name).encode()) == name
        assert m.name_problem(name) is None
    for name in bad:
        with pytest.raises(msgspec.ValidationError):
            dec.decode(json.dumps(name).encode())
        assert m.name_problem(name) is not None


# --- the projector and the replay go on past them -------------------------------------------


def _subject(kind: type[m.Event], node: str = "n1") -> str:
    if kind in (m.NodeInventoryReported, m.GpuHealthChanged, m.NodeLost):
        return subjects.fleet(node, "inventory" if kind is m.NodeInventoryReported else "health")
    if kind is m.ReplicaStateChanged:
        return subjects.replica("m-r1", "state", node)
    if kind is m.IdleMapPublished:
        return subjects.usage_idle("r")
    return subjects.model("m", "scaled")


async def test_projector_and_replay_go_on_past_every_poison_event(bus: Bus, duckdb_path: Path) -> None:
    """Before: the first commit failed (INT64 cannot be cast to INT32), every restart failed the same."""
    await bus.publish(inventory("n1", "ib-a", 2, t(0)))
    await bus.publish(m.ModelDeclared(at=t(1), spec=spec("m")))
    for i, (kind, data) in enumerate(POISON.values()):
        await bus.publish_bytes(_subject(kind), data, f"poison-{i}")
    await bus.publish(m.ModelScaled(at=t(2), name="m", replicas=2))
    await bus.publish(m.NodeLost(at=t(3), node="n1"))

    live = Projector(bus, Store(duckdb_path))
    cp = await live.run_once()
    assert cp.state.models["m"].replicas_wanted == 2 and cp.state.nodes["n1"].lost
    assert cp.cursor.unprojected == len(POISON)
    store = Store(duckdb_path)
    try:
        assert store.query("SELECT count(*) FROM unprojected_events") == [(len(POISON),)]
        assert store.query("SELECT replicas_wanted FROM models") == [(2,)]
        assert store.query("SELECT count(*) FROM events") == [(4,)]
    finally:
        store.close()
    c = await replay(bus)
    assert status_report.report(c.state, None, 1800, c.cursor, history=c.history) == \
        status_report.report(cp.state, None, 1800, cp.cursor, history=cp.history)


def test_a_message_the_store_cannot_write_is_set_aside_with_the_reason(duckdb_path: Path) -> None:
    """Whatever gets past the decoder's bounds: its rows are refused, the batch is written without them."""
    stored_ns = 1_772_445_600_000_000_000
    good = m.GpuHealthChanged(at=t(1), node="n1", gpu_index=0, gpu_uuid="GPU-n1-0", healthy=False, reasons=("xid 79",))
    bad = _doc(good, gpu_index=2**40)  # as a decoder without bounds let through
    cp = Checkpoint()
    apply(cp.state, inventory("n1", "ib-a", 1, t(0)))
    apply(cp.state, good)
    cp.cursor.positions[subjects.STREAM_FLEET] = 3
    batch = Batch()
    subject = subjects.fleet("n1", "health")
    batch.add_raw(subjects.STREAM_FLEET, [1, 2, 3], [subject] * 3, [stored_ns] * 3, [m.encode(good), bad, m.encode(good)])
    store = Store(duckdb_path)
    try:
        store.commit(batch, encode_state(cp.state, cp.cursor))
        assert store.query("SELECT seq FROM gpu_health ORDER BY seq") == [(1,), (3,)]
        rows = store.query("SELECT stream, seq, subject, raw, error FROM unprojected_events")
        assert [(r[0], r[1], r[2], bytes(r[3])) for r in rows] == [(subjects.STREAM_FLEET, 2, subject, bad)]
        assert rows[0][4].startswith("the store cannot write it: ") and "INT" in rows[0][4]
        assert store.query("SELECT stream, seq FROM positions") == [(subjects.STREAM_FLEET, 3)]
    finally:
        store.close()


# --- event times are bounded by the stream's own ------------------------------------------------


def test_clamp_times_bounds_each_event_by_its_own_store_time() -> None:
    stored = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    ns = int((stored - datetime(1970, 1, 1, tzinfo=UTC)).total_seconds()) * 10**9
    assert stored_at(ns) == stored
    ahead_ok = stored + MAX_AHEAD
    events: list[Any] = [
        m.NodeLost(at=datetime(9999, 12, 31, tzinfo=UTC), node="a"),
        m.NodeLost(at=ahead_ok, node="b"),
        m.NodeLost(at=ahead_ok + timedelta(microseconds=1), node="c"),
        m.NodeLost(at=stored - MAX_BEHIND, node="d"),
        m.NodeLost(at=datetime(1, 1, 1, tzinfo=UTC), node="e"),
        m.NodeLost(at=stored - timedelta(days=300), node="f"),  # delivered late (an outbox after an outage): kept
    ]
    before = list(events)
    assert clamp_times(events, [ns] * len(events)) == 3
    assert [e.at for e in events] == [stored, ahead_ok, stored, stored - MAX_BEHIND, stored, before[5].at]
    # Whether an event is clamped depends on it alone, not on the batch it came in.
    for i, e in enumerate(before):
        one = [e]
        clamp_times(one, [ns])
        assert one[0] == events[i]
    # A batch whose store times go back (a server's clock stepped) is judged event by event too.
    mixed: list[Any] = [m.NodeLost(at=stored + timedelta(minutes=4), node="x")] * 2
    assert clamp_times(mixed, [ns + 10 * 60 * 10**9, ns - 10 * 60 * 10**9]) == 1
    assert mixed[0].at == stored + timedelta(minutes=4) and mixed[1].at == stored - timedelta(minutes=10)


async def test_an_event_dated_9999_does_not_set_the_status_clock(bus: Bus, duckdb_path: Path) -> None:
    """Before: "Fleet at 9999-12-31", every replica idle 2912109d, for good."""
    now = datetime.now(UTC)
    await bus.publish(inventory("n1", "ib-a", 2, now))
    ack = await bus.publish(inventory("n2", "ib-a", 2, datetime(9999, 12, 31, tzinfo=UTC)))
    await bus.publish(m.ModelDeclared(at=datetime(9999, 12, 31, tzinfo=UTC), spec=spec("m")))
    live = Projector(bus, Store(duckdb_path))
    cp = await live.run_once()
    report = status_report.report(cp.state, None, 1800, cp.cursor)
    assert report.now is not None and report.now < now + timedelta(minutes=5)
    assert report.clamped_events == 2
    c = await replay(bus)
    assert status_report.report(c.state, None, 1800, c.cursor) == report
    store = Store(duckdb_path)
    try:
        (ts,), = store.query("SELECT ts FROM events WHERE stream = ? AND seq = ?", [ack.stream, ack.seq])
        assert ts == cp.state.nodes["n2"].updated_at  # DuckDB's history takes the same time as the fold
    finally:
        store.close()


# --- a scale below what could not be placed clears "unplaceable" ----------------------------------


def test_a_scale_clears_unplaceable_in_the_fold() -> None:
    state = fold([inventory("n1", "ib-a", 2, t(0)), m.ModelDeclared(at=t(1), spec=spec("m", replicas=5)),
                  m.ModelUnplaceable(at=t(2), name="m", reason="needs 1 × H100-80GB on one node; …", missing_replicas=3),
                  m.ModelScaled(at=t(3), name="m", replicas=2)])
    assert state.models["m"].unplaceable_reason is None
    assert state.model_states()["m"] == "parked"


def test_the_scheduler_says_unplaceable_again_under_a_new_id_after_a_scale() -> None:
    """Scaled down (cleared), then up again past the fleet: the same reason must be stored again, not
    dropped by the server as a duplicate of the first (the same Nats-Msg-Id within its window)."""
    now = t(10)
    events: list[m.Event] = [inventory("n1", "ib-a", 1, t(0)), m.ModelDeclared(at=t(1), spec=spec("m", replicas=3))]
    state, memory = FleetState(), demand.SchedulerMemory()
    seq = [0]

    def feed(evs: list[m.Event]) -> None:
        for e in evs:
            seq[0] += 1
            demand.observe(memory, e, state, seq=seq[0])
            apply(state, e)

    feed(events)
    first = scheduler.decide(state, memory, now)
    placed = [d.event for d in first if isinstance(d.event, m.ReplicaPlaced)]
    unplaceable = [d for d in first if isinstance(d.event, m.ModelUnplaceable)]
    assert len(placed) == 1 and len(unplaceable) == 1
    feed([*placed, unplaceable[0].event, m.ModelScaled(at=t(11), name="m", replicas=1)])
    assert state.model_states()["m"] != "unplaceable" and state.models["m"].unplaceable_reason is None
    assert [d for d in scheduler.decide(state, memory, now) if isinstance(d.event, m.ModelUnplaceable)] == []
    feed([m.ModelScaled(at=t(12), name="m", replicas=3)])
    again = [d for d in scheduler.decide(state, memory, now) if isinstance(d.event, m.ModelUnplaceable)]
    assert len(again) == 1 and again[0].msg_id != unplaceable[0].msg_id


def test_small_fleet_still_folds_the_same() -> None:
    """The bounds refuse nothing the project itself publishes."""
    for e in small_fleet():
        assert m.decode_event(m.encode(e)) == e


async def test_a_forged_event_dated_far_off_is_refused_before_it_is_clamped_by_every_reader(
    bus: Bus, duckdb_path: Path,
) -> None:
    """Seen in the poison fault test: the projector counted a refused event's clamp, a replay did not
    (its follower refuses a subject the payload disagrees with before anything else): 6 != 4."""
    now = datetime.now(UTC)
    await bus.publish(inventory("n1", "ib-a", 2, now))
    forged = m.NodeLost(at=datetime(1, 1, 1, tzinfo=UTC), node="n1")  # names n1, stored under n2's subject
    await bus.publish_bytes(subjects.fleet("n2", "lost"), m.encode(forged), "forged-1")
    await bus.publish(m.NodeLost(at=datetime(1, 1, 1, tzinfo=UTC), node="n2"))  # clamped, folded
    cp = await Projector(bus, Store(duckdb_path)).run_once()
    report = status_report.report(cp.state, None, 1800, cp.cursor)
    assert (report.clamped_events, report.unprojected_events) == (1, 1)
    c = await replay(bus)
    assert status_report.report(c.state, None, 1800, c.cursor) == report
