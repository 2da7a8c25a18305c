"""``ModelHistory``: what the fold forgets about a model, folded from the control stream (pure, no I/O)."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import msgspec
import pytest
from projection_events import T0, placed, small_fleet, spec, t

from llmgw import messages as m
from llmgw.fleet.history import RECENT_EVENTS, ModelHistory, split_by_day
from llmgw.fleet.state import fold
from llmgw.fleet.status import model_summaries, report
from llmgw.messages import describe

DAY = date(2026, 3, 2)


def history_of(events: list[m.Event]) -> ModelHistory:
    h = ModelHistory()
    for seq, e in enumerate((e for e in events if isinstance(e, m.ControlEvent)), start=1):
        h.note(seq, e)
    return h


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [
        (T0, T0 + timedelta(hours=1), [(DAY, 3600.0)]),
        (T0 - timedelta(hours=11), T0 - timedelta(hours=9), [(date(2026, 3, 1), 3600.0), (DAY, 3600.0)]),
        (T0, T0, []),
        (T0, T0 - timedelta(hours=1), []),  # a clock behind: nothing, never negative
        (datetime(2026, 2, 28, 12, tzinfo=UTC), datetime(2026, 3, 2, 6, tzinfo=UTC),
         [(date(2026, 2, 28), 43200.0), (date(2026, 3, 1), 86400.0), (DAY, 21600.0)]),
    ],
)
def test_split_by_day(start: datetime, end: datetime, expected: list[tuple[date, float]]) -> None:
    assert split_by_day(start, end) == expected


def test_stopped_replicas_count_on_the_days_they_held_gpus() -> None:
    s = spec("a", tp=2)
    events: list[m.Event] = [
        m.ModelDeclared(at=T0 - timedelta(days=1), spec=s),
        placed("a-r1", s, [("n1", 0), ("n1", 1)], T0 - timedelta(hours=11)),  # 23:00 the day before
        m.ReplicaStopped(at=T0 - timedelta(hours=9), replica_id="a-r1", model="a", reason="idle"),  # 01:00
        placed("a-r2", s, [("n1", 0), ("n1", 1)], t(0)),  # 10:00, running at 11:00
        # Placed again under the same id: the first placement ended then.
        placed("a-r3", s, [("n2", 0), ("n2", 1)], t(10)),
        placed("a-r3", s, [("n3", 0), ("n3", 1)], t(40)),
        m.ReplicaStopped(at=t(50), replica_id="a-r3", model="a", reason="re-placing"),
        m.ReplicaStopped(at=t(55), replica_id="never-placed", model="a", reason="idle"),  # nothing to close
    ]
    h = history_of(events)
    assert h.gpu_seconds_stopped("a", date(2026, 3, 1)) == 2 * 3600
    assert h.gpu_seconds_stopped("a", DAY) == 2 * 3600 + 2 * 30 * 60 + 2 * 10 * 60
    state = fold(events)
    (row,) = model_summaries(state, t(60), h)
    # Stopped: 2 h (a-r1 after midnight) + 1 h 20 (a-r3); running: a-r2, 2 GPUs for an hour.
    assert row.gpu_hours_today == round((2 * 3600 + 2 * 40 * 60 + 2 * 3600) / 3600, 3)
    # Without the history only what runs now counts: never more than the truth.
    assert model_summaries(state, t(60))[0].gpu_hours_today == 2.0


def test_latest_events_per_model_and_only_from_a_replicas_own_nodes() -> None:
    s = spec("b")
    events: list[m.Event] = [m.ModelDeclared(at=t(0), spec=s), placed("b-r1", s, [("n1", 0)], t(1))]
    events += [m.ReplicaStateChanged(at=t(2 + i), replica_id="b-r1", model="b", node="n1", state="starting",
                                     restarts=i) for i in range(RECENT_EVENTS + 5)]
    # Another node speaking for b-r1, and a report for a replica never placed: neither is b's.
    events += [m.ReplicaStateChanged(at=t(90), replica_id="b-r1", model="b", node="n9", state="failed"),
               m.ReplicaStateChanged(at=t(91), replica_id="ghost", model="b", node="n1", state="healthy")]
    h = history_of(events)
    got = h.events("b")
    assert len(got) == RECENT_EVENTS
    assert [e.seq for e in got] == list(range(8, 8 + RECENT_EVENTS))
    assert all(isinstance(e.event, m.ReplicaStateChanged) and e.event.node == "n1" for e in got)
    assert h.position == len(events)
    assert h.events("nobody") == ()


def test_a_report_about_one_model_carries_its_detail_and_survives_the_wire() -> None:
    events = small_fleet()
    state = fold(events)
    r = report(state, history=history_of(events), replicas=True, model="llama-70b")
    assert r.model_detail is not None
    assert [describe(e.event) for e in r.model_detail.events] == [
        "model llama-70b declared: 1 × H100-80GB tp4 pp2 bf16 (vllm)",
        "replica r-llama of llama-70b placed on n2,n3 (8 GPUs, fabric ib-a)",
        "replica r-llama of llama-70b on n2 is healthy",
        "replica r-llama of llama-70b on n3 is healthy",
    ]
    assert m.STATUS_REPORT_DECODER.decode(m.encode(r)) == r
    assert report(state, model="nope").model_detail is None


def test_old_and_new_status_bodies_decode_both_ways() -> None:
    # An older ctl's request, and an older projector's report: the new fields take their defaults.
    req = m.STATUS_REQUEST_DECODER.decode(b'{"idle_threshold_s": 60}')
    assert (req.replicas, req.model) == (False, "")
    new = report(fold(small_fleet()), replicas=True)
    old = msgspec.json.decode(m.encode(new))
    for key in ("model_list", "replica_list", "model_detail"):
        old.pop(key)
    back = m.STATUS_REPORT_DECODER.decode(msgspec.json.encode(old))
    assert (back.model_list, back.replica_list, back.model_detail) == ((), (), None)
    with pytest.raises(msgspec.ValidationError):
        m.STATUS_REQUEST_DECODER.decode(b'{"model": "' + b"x" * 300 + b'"}')


def test_describe_reads_in_the_singular() -> None:
    s = spec("c")
    assert describe(placed("c-r1", s, [("n1", 0)], t(0))) == "replica c-r1 of c placed on n1 (1 GPU, fabric ib-a)"
    assert describe(m.ModelScaled(at=t(0), name="c", replicas=1)) == "model c scaled to 1 replica"
    assert describe(m.ReplicaStateChanged(at=t(1), replica_id="c-r1", model="c", node="n1", state="healthy",
                                          observed_kv_tokens=96_000)) == (
        "replica c-r1 of c on n1 is healthy (reserved 96,000 KV tokens)")


def test_what_an_engine_reserved_outlives_its_replica_until_the_model_is_declared_again() -> None:
    s = msgspec.structs.replace(spec("d"), kv_tokens=50_000)
    events: list[m.Event] = [
        m.ModelDeclared(at=t(0), spec=s), placed("d-r1", s, [("n1", 0)], t(1)),
        m.ReplicaStateChanged(at=t(2), replica_id="d-r1", model="d", node="n1", state="healthy", observed_kv_tokens=48_000),
        m.ReplicaStateChanged(at=t(3), replica_id="d-r1", model="d", node="n9", state="healthy", observed_kv_tokens=9),
        m.ReplicaStopped(at=t(4), replica_id="d-r1", model="d", reason="idle"),
    ]
    (row,) = model_summaries(fold(events), t(5), history_of(events))
    assert (row.state, row.placed, row.kv_tokens_planned, row.kv_tokens_observed) == ("parked", 0, 50_000, 48_000)
    events.append(m.ModelDeclared(at=t(6), spec=s))
    assert model_summaries(fold(events), t(7), history_of(events))[0].kv_tokens_observed == 0


def test_what_a_woken_replica_reserved_is_kept() -> None:
    """A model's cold-start ledger notes its replicas' start and health; their KV reports are kept all the same."""
    s = msgspec.structs.replace(spec("w"), kv_tokens=50_000)
    events: list[m.Event] = [
        m.ModelDeclared(at=t(0), spec=s),
        msgspec.structs.replace(placed("w-r1", s, [("n1", 0)], t(1)), cause="wake", reason="woken by router-a"),
        m.ReplicaStateChanged(at=t(2), replica_id="w-r1", model="w", node="n1", state="starting"),
        m.ReplicaStateChanged(at=t(3), replica_id="w-r1", model="w", node="n1", state="healthy",
                              observed_kv_tokens=48_000),
    ]
    history = history_of(events)
    assert history.observed_kv == {"w": 48_000}
    (start,) = history.cold_starts("w")
    assert (start.started_at, start.healthy_at) == (t(2), t(3))  # the ledger is noted too
