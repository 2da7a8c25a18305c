"""Table-driven tests of the pure fold: events in, state out, no clock, no I/O."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from projection_events import inventory, placed, small_fleet, spec, t

from llmgw import messages as m
from llmgw.bus.frames import RawMsg
from llmgw.fleet.fold import (
    EVERY,
    Checkpoint,
    Memories,
    decode_state,
    encode_state,
    fold_batch,
)
from llmgw.fleet.state import Cursor, FleetState, fold
from llmgw.subjects import stream_for_subject

QWEN = spec("qwen-8b")
LLAMA = spec("llama-70b", tp=4, pp=2)


def gpu_health(state: FleetState) -> dict[tuple[str, int], tuple[bool, datetime | None]]:
    return {(g.node, g.index): (g.healthy, g.since) for g in state.gpus()}


CASES: list[tuple[str, list[m.Event], Callable[[FleetState], object], object]] = [
    (
        "inventory lists every GPU with class and memory",
        [inventory("n1", "ib-a", 2, t(0)), inventory("n2", "pcie", 1, t(0), gpu_class="L40S-48GB")],
        lambda s: sorted((g.node, g.index, g.gpu_class, g.memory_mib) for g in s.gpus()),
        [("n1", 0, "H100-80GB", 81559), ("n1", 1, "H100-80GB", 81559), ("n2", 0, "L40S-48GB", 46068)],
    ),
    (
        "a second inventory replaces the first (a GPU fell off the bus)",
        [inventory("n1", "ib-a", 4, t(0)), inventory("n1", "ib-b", 3, t(5))],
        lambda s: (s.nodes["n1"].fabric, sorted(s.nodes["n1"].gpus)),
        ("ib-b", [0, 1, 2]),
    ),
    (
        "an unchanged GPU keeps its health time across inventories",
        [inventory("n1", "ib-a", 1, t(0)), inventory("n1", "ib-a", 1, t(5))],
        lambda s: s.nodes["n1"].gpus[0].since,
        t(0),
    ),
    (
        "health goes bad then recovers, with the time of each transition",
        [
            inventory("n1", "ib-a", 2, t(0)),
            m.GpuHealthChanged(at=t(1), node="n1", gpu_index=1, gpu_uuid="GPU-n1-1", healthy=False, reasons=("xid-79",)),
            m.GpuHealthChanged(at=t(9), node="n1", gpu_index=0, gpu_uuid="GPU-n1-0", healthy=False),
            m.GpuHealthChanged(at=t(12), node="n1", gpu_index=0, gpu_uuid="GPU-n1-0", healthy=True),
        ],
        gpu_health,
        {("n1", 0): (True, t(12)), ("n1", 1): (False, t(1))},
    ),
    (
        "health of a node never inventoried is ignored, not a crash",
        [m.GpuHealthChanged(at=t(1), node="ghost", gpu_index=0, gpu_uuid="x", healthy=False)],
        lambda s: (s.nodes, s.as_of),
        ({}, t(1)),
    ),
    (
        "NodeLost takes a node's GPUs out of free; NodeReturned brings them back",
        [inventory("n1", "ib-a", 2, t(0)), m.NodeLost(at=t(3), node="n1")],
        lambda s: (s.nodes["n1"].lost, s.nodes["n1"].lost_at, len(s.free_gpus(s.nodes["n1"]))),
        (True, t(3), 0),
    ),
    (
        "NodeReturned",
        [inventory("n1", "ib-a", 2, t(0)), m.NodeLost(at=t(3), node="n1"), m.NodeReturned(at=t(4), node="n1")],
        lambda s: (s.nodes["n1"].lost, len(s.free_gpus(s.nodes["n1"]))),
        (False, 2),
    ),
    (
        "an inventory after NodeLost means the agent speaks again",
        [inventory("n1", "ib-a", 2, t(0)), m.NodeLost(at=t(3), node="n1"), inventory("n1", "ib-a", 2, t(4))],
        lambda s: s.nodes["n1"].lost,
        False,
    ),
    (
        "a placed multi-node replica holds GPUs on both nodes",
        [inventory("n1", "ib-a", 4, t(0)), inventory("n2", "ib-a", 4, t(0)),
         placed("r1", LLAMA, [("n1", i) for i in range(4)] + [("n2", i) for i in range(4)], t(1))],
        lambda s: (s.replicas["r1"].state, len(s.held_gpus()), len(s.free_gpus(s.nodes["n2"]))),
        ("placed", 8, 0),
    ),
    (
        "replica states follow the agent; a stopped state report keeps the last real state",
        [placed("r1", QWEN, [("n1", 0)], t(1)),
         m.ReplicaStateChanged(at=t(2), replica_id="r1", model="qwen-8b", node="n1", state="starting"),
         m.ReplicaStateChanged(at=t(3), replica_id="r1", model="qwen-8b", node="n1", state="healthy", endpoint="http://n1:8000"),
         m.ReplicaStateChanged(at=t(4), replica_id="r1", model="qwen-8b", node="n1", state="stopped")],
        lambda s: (s.replicas["r1"].state, s.replicas["r1"].state_at, s.replicas["r1"].endpoint),
        ("healthy", t(3), "http://n1:8000"),
    ),
    (
        "ReplicaStopped gives the GPUs back",
        [inventory("n1", "ib-a", 1, t(0)), placed("r1", QWEN, [("n1", 0)], t(1)),
         m.ReplicaStopped(at=t(2), replica_id="r1", model="qwen-8b", reason="idle")],
        lambda s: (s.replicas, len(s.free_gpus(s.nodes["n1"]))),
        ({}, 1),
    ),
    (
        "unplaceable until a replica lands",
        [m.ModelDeclared(at=t(0), spec=QWEN), m.ModelUnplaceable(at=t(1), name="qwen-8b", reason="no free H100"),
         placed("r1", QWEN, [("n1", 0)], t(2))],
        lambda s: (s.models["qwen-8b"].unplaceable_reason, s.models["qwen-8b"].replicas_wanted),
        (None, 1),
    ),
    (
        "two routers: the newest last request wins, whichever router saw it",
        [m.IdleMapPublished(at=t(10), router="a", boot_id="a1", tick=1, last_request={"r1": t(9)}),
         m.IdleMapPublished(at=t(10), router="b", boot_id="b1", tick=1, last_request={"r1": t(4)}),
         m.IdleMapPublished(at=t(20), router="b", boot_id="b1", tick=2, last_request={"r1": t(5)})],
        lambda s: s.idle_since("r1"),
        t(9),
    ),
    (
        "a restarted router that knows nothing does not make a replica look idle",
        [m.IdleMapPublished(at=t(10), router="a", boot_id="a1", tick=1, last_request={"r1": t(9)}),
         m.IdleMapPublished(at=t(60), router="a", boot_id="a2", tick=1)],
        lambda s: s.idle_since("r1"),
        t(9),
    ),
    (
        "a replica that left every router's map is forgotten (stopped replicas do not pile up)",
        [m.IdleMapPublished(at=t(10), router="a", boot_id="a1", tick=1, last_request={"r1": t(9), "r2": t(8)}),
         m.IdleMapPublished(at=t(10), router="b", boot_id="b1", tick=1, serving_since={"r2": t(3)}),
         m.IdleMapPublished(at=t(20), router="a", boot_id="a1", tick=2)],
        lambda s: (s.last_request, s.idle_since("r2")),
        ({"r2": t(8)}, t(8)),
    ),
    (
        "never asked for since the router began routing: idle since then, not forever",
        [m.IdleMapPublished(at=t(10), router="a", boot_id="a1", tick=1, serving_since={"r1": t(2)})],
        lambda s: s.idle_since("r1"),
        t(2),
    ),
    (
        "a router starting under a new name (a rolled-out pod) does not restart a replica's idle time",
        [m.IdleMapPublished(at=t(10), router="a", boot_id="a1", tick=1, last_request={"r1": t(9)}),
         m.IdleMapPublished(at=t(50), router="a-7f9c", boot_id="c1", tick=1, serving_since={"r1": t(50)})],
        lambda s: s.idle_since("r1"),
        t(9),
    ),
    (
        "routers that were never asked: idle since the first of them began routing",
        [m.IdleMapPublished(at=t(10), router="a", boot_id="a1", tick=1, serving_since={"r1": t(2)}),
         m.IdleMapPublished(at=t(40), router="b", boot_id="b1", tick=1, serving_since={"r1": t(30)})],
        lambda s: s.idle_since("r1"),
        t(2),
    ),
    (
        "a request or a map from before the replica was placed (its id's earlier life) does not count",
        [m.IdleMapPublished(at=t(10), router="a", boot_id="a1", tick=1, last_request={"r1": t(9)},
                            serving_since={"r2": t(5)}),
         placed("r1", QWEN, [("n1", 0)], t(100)), placed("r2", QWEN, [("n1", 1)], t(100))],
        lambda s: (s.idle_since("r1"), s.idle_since("r2")),
        (None, None),
    ),
    (
        "no router knows: unknown, not idle",
        [m.IdleMapPublished(at=t(10), router="a", boot_id="a1", tick=1, last_request={"r2": t(9)})],
        lambda s: s.idle_since("r1"),
        None,
    ),
    (
        "heartbeats are not history",
        [m.HeartbeatSent(at=t(1), node="n1", boot_id="b", seq=1)],
        lambda s: (s.nodes, s.as_of),
        ({}, t(1)),
    ),
]


@pytest.mark.parametrize(("events", "view", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_fold(events: list[m.Event], view: Callable[[FleetState], object], expected: object) -> None:
    assert view(fold(events)) == expected


def test_fold_is_independent_of_how_streams_interleave() -> None:
    events = small_fleet()
    fleet = [e for e in events if isinstance(e, m.FleetEvent)]
    other = [e for e in events if e not in fleet]
    assert fold(fleet + other) == fold(other + fleet) == fold(events)


def test_state_round_trips_through_the_checkpoint_encoding() -> None:
    state, cursor = fold(small_fleet()), Cursor(positions={"LLMGW_FLEET": 7}, unprojected=2)
    assert decode_state(encode_state(state, cursor)) == Checkpoint(state, cursor)


# A random run of idle maps from two routers (restarts included): the fold looks only at
# entries that moved since the router's previous map, and must end with what a naive
# reading of the maps gives: the newest request each replica got since it last left
# every router's map (as seen by a router that did not restart in between).
_maps = st.lists(
    st.tuples(
        st.sampled_from(["rt-a", "rt-b"]),
        st.booleans(),  # restart: a new boot
        st.dictionaries(st.sampled_from(["r1", "r2", "r3"]), st.integers(0, 20), max_size=3),
        st.lists(st.sampled_from(["r1", "r2", "r3", "r4"]), max_size=2),  # serving, no request yet
    ),
    max_size=25,
)


def newest_requests(events: list[m.IdleMapPublished]) -> dict[str, datetime]:
    """The reference: every map's every entry, nothing incremental."""
    maps: dict[str, m.IdleMapPublished] = {}
    newest: dict[str, datetime] = {}
    for e in events:
        before = maps.get(e.router)
        maps[e.router] = e
        for r, when in e.last_request.items():
            newest[r] = max(when, newest.get(r, when))
        if before is not None and before.boot_id == e.boot_id:
            listed = {r for x in maps.values() for r in [*x.last_request, *x.serving_since]}
            for r in [*before.last_request, *before.serving_since]:
                if r not in listed:
                    newest.pop(r, None)
    return newest


@hsettings(max_examples=300, deadline=None)
@given(_maps)
def test_newest_request_follows_the_maps(maps: list[tuple[str, bool, dict[str, int], list[str]]]) -> None:
    boots = {"rt-a": 0, "rt-b": 0}
    events = []
    for tick, (router, restart, seen, serving) in enumerate(maps):
        boots[router] += restart
        events.append(m.IdleMapPublished(
            at=t(100 + tick), router=router, boot_id=f"{router}-{boots[router]}", tick=tick,
            last_request={r: t(s) for r, s in seen.items()},
            serving_since={r: t(tick) for r in serving if r not in seen}))
    assert fold(events).last_request == newest_requests(events)


def test_a_replica_over_two_nodes_is_healthy_only_when_both_parts_are() -> None:
    from llmgw.router.endpoints import Pool

    s = spec("big")
    two = m.ReplicaPlaced(at=t(0), replica_id="big-r1", model="big", nodes=("n1", "n2"), spec=s, fabric="ib-a",
                          gpus=(m.GpuRef(node="n1", index=0, uuid="GPU-n1-0"), m.GpuRef(node="n2", index=0, uuid="GPU-n2-0")))

    def part(node: str, state: str, endpoint: str = "") -> m.ReplicaStateChanged:
        return m.ReplicaStateChanged(at=t(1), replica_id="big-r1", model="big", node=node, state=state,  # type: ignore[arg-type]
                                     endpoint=endpoint)

    steps = [
        (part("n1", "healthy", "http://n1:8000"), "starting", False),  # the head alone is not the replica
        (part("n3", "healthy", "http://evil:1"), "starting", False),  # not one of its nodes: ignored
        (part("n2", "healthy"), "healthy", True),
        (part("n2", "unhealthy"), "unhealthy", False),  # a part down takes the whole replica down
        (part("n2", "healthy"), "healthy", True),
        (part("n2", "failed"), "failed", False),
    ]
    state = fold([*[inventory(n, "ib-a", 1, t(0)) for n in ("n1", "n2")], two])
    pool = Pool()
    pool.apply(two, 0.0)
    for event, want, routable in steps:
        fold([event], state)
        pool.apply(event, 0.0)
        assert state.replicas["big-r1"].state == want, event
        assert bool(pool.healthy.get("big")) == routable, event
        assert state.replicas["big-r1"].endpoint == "http://n1:8000"
    assert [r.endpoint for r in pool.replicas.values()] == ["http://n1:8000"]  # a worker never moves the endpoint


# --- a subject is a claim: the payload must agree, and only a replica's own nodes speak for it ---

QWEN_ON_N1 = placed("r-q", QWEN, [("n1", 0)], t(1))


def state_of(rid: str, node: str, state: str = "healthy", endpoint: str = "") -> m.ReplicaStateChanged:
    return m.ReplicaStateChanged(at=t(2), replica_id=rid, model="qwen-8b", node=node, state=state,  # type: ignore[arg-type]
                                 endpoint=endpoint)


REFUSALS: list[tuple[str, str, m.Event, bool]] = [
    ("an inventory naming another node on the agent's own subject", "llmgw.fleet.n1.inventory",
     inventory("n2", "ib-a", 1, t(2)), True),
    ("its own inventory", "llmgw.fleet.n2.inventory", inventory("n2", "ib-a", 1, t(2)), False),
    ("NodeLost for another node on its own .lost", "llmgw.fleet.n1.lost", m.NodeLost(at=t(2), node="n2"), True),
    ("health of another node on its own subject", "llmgw.fleet.n1.health",
     m.GpuHealthChanged(at=t(2), node="n2", gpu_index=0, gpu_uuid="GPU-n2-0", healthy=False), True),
    ("an inventory on its own health subject", "llmgw.fleet.n2.health", inventory("n2", "ib-a", 1, t(2)), True),
    ("state of a replica on n1 from n2, on n2's own subject", "llmgw.control.replica.r-q.state.n2",
     state_of("r-q", "n2", endpoint="http://evil:1"), True),
    ("state from n2 claiming to be n1", "llmgw.control.replica.r-q.state.n2", state_of("r-q", "n1"), True),
    ("'stopped' from a node it is not on (would empty the router's pool)", "llmgw.control.replica.r-q.state.n2",
     state_of("r-q", "n2", "stopped"), True),
    ("its own node's report", "llmgw.control.replica.r-q.state.n1", state_of("r-q", "n1"), False),
    ("a replica never placed (or stopped): nothing to believe, nothing refused", "llmgw.control.replica.gone.state.n2",
     state_of("gone", "n2"), False),
    ("a payload with no node at all", "llmgw.fleet.n1.lost", m.NodeLost(at=t(2), node=""), True),
    ("a declaration on its own subject", "llmgw.control.model.qwen-8b.declared",
     m.ModelDeclared(at=t(2), spec=QWEN), False),
    # Round 3: every event only on its own subject, not only those that name a node.
    ("a placement an agent publishes on its own state subject (an engine started on another node)",
     "llmgw.control.replica.evil-r1.state.n2", placed("evil-r1", QWEN, [("n1", 0)], t(2)), True),
    ("a placement the CLI publishes on its `ctl idle --stop` subject", "llmgw.control.replica.evil-r1.stopped",
     placed("evil-r1", QWEN, [("n1", 0)], t(2)), True),
    ("a declaration under another model's name", "llmgw.control.model.other.declared",
     m.ModelDeclared(at=t(2), spec=QWEN), True),
    ("an idle map on another router's subject", "llmgw.usage.rt-b.idle",
     m.IdleMapPublished(at=t(2), router="rt-a", boot_id="a", tick=1), True),
]


@pytest.mark.parametrize(("subject", "event", "refused"), [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS])
def test_an_event_is_refused_when_its_subject_or_placement_disagrees(subject: str, event: m.Event, refused: bool) -> None:
    from llmgw.fleet import refusal

    state = fold([inventory("n1", "ib-a", 1, t(0)), inventory("n2", "ib-a", 1, t(0)), m.ModelDeclared(at=t(0), spec=QWEN),
                  QWEN_ON_N1])
    why = refusal(state, subject, event)
    assert (why is not None) is refused, why


def _keeps() -> dict[str, Memories]:
    from llmgw.agent.supervisor import ENGINES_KEEP
    from llmgw.planner.service import PLANNER_KEEPS
    from llmgw.router.endpoints import ROUTER_KEEPS
    from llmgw.scheduler.liveness import LIVENESS_KEEPS

    return {"every": EVERY, "planner": PLANNER_KEEPS, "router": ROUTER_KEEPS, "liveness": LIVENESS_KEEPS,
            "engines": ENGINES_KEEP, "none": Memories(history=False, demand=False, observed=False, pool=False, lost=False)}


@pytest.mark.parametrize("reader", ["planner", "router", "liveness", "engines", "none"])
def test_every_reader_refuses_clamps_and_applies_alike_whatever_it_remembers(reader: str) -> None:
    """The one fold rule: a reader that keeps fewer memories refuses, clamps and folds the same events."""
    setup: list[tuple[str, m.Event]] = [("llmgw.fleet.n1.inventory", inventory("n1", "ib-a", 1, t(0))),
                                        ("llmgw.fleet.n2.inventory", inventory("n2", "ib-a", 1, t(0))),
                                        ("llmgw.control.model.qwen-8b.declared", m.ModelDeclared(at=t(0), spec=QWEN)),
                                        ("llmgw.control.replica.r-q.placed", QWEN_ON_N1)]
    # Every case above, one after another, and one dated a year away from when it was stored (clamped).
    far = m.ModelScaled(at=datetime(2027, 1, 1, tzinfo=t(0).tzinfo), name="qwen-8b", replicas=2)
    events = [*setup, *((subject, event) for _, subject, event, _ in REFUSALS),
              ("llmgw.control.model.qwen-8b.scaled", far)]

    def folded(keep: Memories) -> tuple[list[str | None], Checkpoint]:
        c = Checkpoint()
        why: list[str | None] = []
        for seq, (subject, event) in enumerate(events, 1):
            stored = RawMsg(seq=seq, subject=subject, data=b"", ts_ns=int(t(2).timestamp() * 1e9))
            why += fold_batch(c, stream_for_subject(subject), [stored], [event], keep=keep)
        return why, c

    (every_why, every), (why, c) = folded(EVERY), folded(_keeps()[reader])
    assert why == every_why and sum(w is not None for w in why) == sum(r for *_, r in REFUSALS)
    assert (c.state, c.cursor) == (every.state, every.cursor) and c.cursor.clamped >= 1


def test_a_refused_report_is_no_part_of_a_models_history() -> None:
    """`ctl model show` lists a model's latest events: a stranger's report, refused, is not one of them."""
    c = Checkpoint()
    events = [("llmgw.control.model.qwen-8b.declared", m.ModelDeclared(at=t(0), spec=QWEN)),
              ("llmgw.control.replica.r-q.placed", QWEN_ON_N1),
              ("llmgw.control.replica.r-q.state.n2", state_of("r-q", "n2", endpoint="http://evil:1")),
              ("llmgw.control.replica.r-q.state.n1", state_of("r-q", "n1", endpoint="http://n1:8000"))]
    for seq, (subject, event) in enumerate(events, 1):
        fold_batch(c, "LLMGW_CONTROL", [RawMsg(seq=seq, subject=subject, data=b"", ts_ns=int(t(2).timestamp() * 1e9))],
                   [event])
    noted = [e.event for e in c.history.recent["qwen-8b"]]
    assert [type(e).__name__ for e in noted] == ["ModelDeclared", "ReplicaPlaced", "ReplicaStateChanged"]
    assert all(getattr(e, "node", "n1") == "n1" for e in noted) and c.cursor.unprojected == 1


def test_a_replica_takes_state_only_from_its_own_node() -> None:
    events: list[m.Event] = [inventory("n1", "ib-a", 1, t(0)), inventory("n2", "ib-a", 1, t(0)),
                             m.ModelDeclared(at=t(0), spec=QWEN), QWEN_ON_N1]
    state = fold([*events, state_of("r-q", "n2", endpoint="http://evil:1")])
    assert (state.replicas["r-q"].state, state.replicas["r-q"].endpoint) == ("placed", "")
    state = fold([*events, state_of("r-q", "n1", endpoint="http://n1:8000")])
    assert (state.replicas["r-q"].state, state.replicas["r-q"].endpoint) == ("healthy", "http://n1:8000")


def test_the_routers_pool_takes_state_only_from_a_placed_replicas_nodes() -> None:
    """The router's fold refuses a stranger's report before its pool sees it (the one rule, fold_batch)."""
    from llmgw.router.endpoints import ROUTER_KEEPS

    c = Checkpoint()
    refused = 0
    for seq, (subject, event) in enumerate([
        ("llmgw.control.replica.never-placed.state.n2", state_of("never-placed", "n2", endpoint="http://evil:1")),
        ("llmgw.control.replica.r-q.placed", QWEN_ON_N1),
        ("llmgw.control.replica.r-q.state.n2", state_of("r-q", "n2", endpoint="http://evil:1")),
        ("llmgw.control.replica.r-q.state.n1", state_of("r-q", "n1", endpoint="http://n1:8000")),
        ("llmgw.control.replica.r-q.state.n2", state_of("r-q", "n2", "stopped")),  # nor take it out of the pool
    ], 1):
        stored = RawMsg(seq=seq, subject=subject, data=b"", ts_ns=int(t(2).timestamp() * 1e9))
        refused += sum(w is not None for w in fold_batch(c, "LLMGW_CONTROL", [stored], [event], keep=ROUTER_KEEPS))
    pool = c.pool
    assert "never-placed" not in pool.replicas
    assert [r.endpoint for r in pool.healthy["qwen-8b"]] == ["http://n1:8000"]
    assert refused == 2
