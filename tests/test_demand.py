"""The demand loop, pure: a wish wakes a parked model, load scales it, and replay order never matters."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from llmgw import messages as m
from llmgw import subjects
from llmgw.fleet import demand
from llmgw.fleet.state import FleetState, apply
from llmgw.fleetfile import FleetNode, inventory
from llmgw.scheduler import placement as s

T0 = datetime(2026, 1, 1, tzinfo=UTC)
STREAM_OF = {"fleet": subjects.STREAM_FLEET, "control": subjects.STREAM_CONTROL, "usage": subjects.STREAM_USAGE}


def spec(name: str = "m", **kw: object) -> m.ModelSpec:
    return m.ModelSpec(name=name, source="org/m", precision="bf16", engine="vllm", gpu_class="H100-80GB",
                       context=4096, **kw)  # type: ignore[arg-type]


class World:
    """Streams as JetStream keeps them (sequence per stream), and a scheduler folding them."""

    def __init__(self, gpus: int = 8) -> None:
        self.log: list[tuple[str, int, str, m.Event]] = []  # (stream, seq, subject, event)
        self.seqs = {x: 0 for x in STREAM_OF.values()}
        self.state, self.memory = FleetState(), demand.SchedulerMemory()
        self.tick = 0
        self.feed(inventory(FleetNode(name="n1", fabric="ib", gpu_class="H100-80GB", gpu_count=gpus,
                                      gpu_memory_mib=81559), T0))

    def store(self, event: m.Event, subject: str | None = None) -> int:
        subject = subject or subjects.subject_for(event)
        stream = subjects.stream_for_subject(subject)
        self.seqs[stream] += 1
        self.log.append((stream, self.seqs[stream], subject, event))
        return self.seqs[stream]

    def feed(self, event: m.Event, subject: str | None = None) -> int:
        seq = self.store(event, subject)
        demand.observe(self.memory, event, self.state, seq, self.log[-1][2])
        apply(self.state, event)
        return seq

    def step(self, now: datetime = T0) -> list[m.Event]:
        events = [d.event for d in s.decide(self.state, self.memory, now)]
        for e in events:
            self.feed(e)
        return events

    def healthy(self, events: list[m.Event]) -> None:
        for e in events:
            if isinstance(e, m.ReplicaPlaced):
                self.feed(m.ReplicaStateChanged(at=T0, replica_id=e.replica_id, model=e.model, node=e.nodes[0],
                                                state="healthy", endpoint="http://x"))

    def load(self, model: str, in_flight: int, busy: dict[str, int] | None = None, router: str = "gw-a",
             queued: int = 0) -> None:
        self.tick += 1
        at = T0 + timedelta(seconds=self.tick)
        self.feed(m.IdleMapPublished(at=at, router=router, boot_id="b", tick=self.tick, tick_s=1.0,
                                     load={model: m.ModelLoad(in_flight=in_flight, queued=queued)},
                                     busy=busy or {}, control_seq=self.seqs[subjects.STREAM_CONTROL]))

    def wish(self, model: str, router: str = "gw-a", subject: str | None = None) -> None:
        control_seq = self.seqs[subjects.STREAM_CONTROL]
        self.feed(m.ModelWanted(at=T0, router=router, boot_id="b", model=model, control_seq=control_seq),
                  subject)

    def running(self, model: str = "m") -> list[str]:
        return sorted(r.replica_id for r in self.state.replicas.values() if r.model == model)


def placed(events: list[m.Event]) -> list[m.ReplicaPlaced]:
    return [e for e in events if isinstance(e, m.ReplicaPlaced)]


def stopped(events: list[m.Event]) -> list[m.ReplicaStopped]:
    return [e for e in events if isinstance(e, m.ReplicaStopped)]


def parked_world() -> World:
    """One replica of ``m`` (idle ttl 60 s), stopped for idleness: parked."""
    w = World()
    w.feed(m.ModelDeclared(at=T0, spec=spec(idle_ttl_s=60.0)))
    w.healthy(w.step())
    w.feed(m.IdleMapPublished(at=T0, router="gw-a", boot_id="b", tick=1, serving_since={"m-r1": T0}))
    stops = stopped(w.step(T0 + timedelta(seconds=61)))
    assert [x.reason.split(":")[0] for x in stops] == ["idle"]
    assert w.running() == [] and w.step(T0 + timedelta(seconds=62)) == []  # parked: nothing comes back by itself
    return w


def test_a_wish_after_the_idle_stop_wakes_the_model_with_its_reason() -> None:
    w = parked_world()
    w.wish("m", router="gw-a")
    got = placed(w.step(T0 + timedelta(seconds=63)))
    assert [p.replica_id for p in got] == ["m-r2"]
    assert got[0].reason == "woken by gw-a: 1 request waiting"
    assert w.state.model_states() == {"m": "starting"}
    assert w.step(T0 + timedelta(seconds=64)) == []  # one placement, however often it is asked


def test_a_wish_that_had_not_seen_the_idle_stop_wakes_nothing() -> None:
    w = World()
    w.feed(m.ModelDeclared(at=T0, spec=spec(idle_ttl_s=60.0)))
    w.healthy(w.step())
    early = w.seqs[subjects.STREAM_CONTROL]  # the router's view before the stop
    w.feed(m.IdleMapPublished(at=T0, router="gw-a", boot_id="b", tick=1, serving_since={"m-r1": T0}))
    w.step(T0 + timedelta(seconds=61))
    w.feed(m.ModelWanted(at=T0, router="gw-a", boot_id="b", model="m", control_seq=early))
    assert w.step(T0 + timedelta(seconds=62)) == []
    assert w.state.model_states() == {"m": "parked"}


def test_forged_and_unknown_wishes_are_counted_and_change_nothing() -> None:
    w = parked_world()
    w.wish("m", router="gw-a", subject=subjects.usage_wanted("gw-b"))  # gw-b's subject, gw-a's name
    w.wish("no-such-model")
    assert w.step(T0 + timedelta(seconds=63)) == []
    assert (w.memory.refused_claims, w.memory.ignored_wishes) == (1, 1)


def replay_decisions(log: list[tuple[str, int, str, m.Event]], order: list[str], now: datetime) -> list[m.Event]:
    """A fresh scheduler folding ``log`` with the streams interleaved as ``order`` says, then deciding."""
    state, memory = FleetState(), demand.SchedulerMemory()
    queues = {x: [e for e in log if e[0] == x] for x in STREAM_OF.values()}
    for stream in order:
        _, seq, subject, event = queues[stream].pop(0)
        demand.observe(memory, event, state, seq, subject)
        apply(state, event)
    return [d.event for d in s.decide(state, memory, now)]


def interleavings(log: list[tuple[str, int, str, m.Event]], n: int, seed: int) -> list[list[str]]:
    """Each stream's own order kept, the streams shuffled among each other: what replay may see."""
    streams = [e[0] for e in log]
    rng = random.Random(seed)
    out = [sorted(streams, key=lambda x: list(STREAM_OF.values()).index(x)),  # fleet, control, usage
           sorted(streams, key=lambda x: -list(STREAM_OF.values()).index(x))]  # usage first
    for _ in range(n):
        shuffled = streams[:]
        rng.shuffle(shuffled)
        out.append(shuffled)
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_replay_in_any_interleaving_decides_what_the_live_scheduler_decided(seed: int) -> None:
    # Live: parked, woken, parked again, woken again by another router; an autoscaled model scaled up.
    w = parked_world()
    w.wish("m")
    w.healthy(w.step(T0 + timedelta(seconds=63)))
    w.feed(m.IdleMapPublished(at=T0 + timedelta(seconds=64), router="gw-a", boot_id="b", tick=2,
                              serving_since={"m-r2": T0 + timedelta(seconds=64)}))
    assert stopped(w.step(T0 + timedelta(seconds=200)))
    w.feed(m.ModelDeclared(at=T0, spec=spec("auto", min_replicas=0, max_replicas=3, target_in_flight=2.0, replicas=1)))
    w.healthy(w.step(T0 + timedelta(seconds=201)))
    for _ in range(3):
        w.load("auto", 5)
    w.wish("m", router="gw-b")
    live = w.step(T0 + timedelta(seconds=202))
    assert {type(e).__name__ for e in live} == {"ModelAutoscaled", "ReplicaPlaced"}
    now = T0 + timedelta(seconds=202)
    # A scheduler restarting here folds the stored history in some interleaving and must decide the same.
    before_live = w.log[: len(w.log) - len(live)]
    for order in interleavings(before_live, 20, seed):
        assert replay_decisions(before_live, order, now) == live
    # And once the live decisions are stored too, a restarted scheduler has nothing left to do.
    for order in interleavings(w.log, 20, seed):
        assert replay_decisions(w.log, order, now) == []


def autoscaled_world(**kw: object) -> World:
    w = World(gpus=8)
    w.feed(m.ModelDeclared(at=T0, spec=spec(**{"min_replicas": 1, "max_replicas": 6, "target_in_flight": 4.0,
                                                "replicas": 1, **kw})))
    w.healthy(w.step())
    return w


def test_load_above_target_for_three_maps_scales_up_and_places_at_once() -> None:
    w = autoscaled_world()
    w.load("m", 30)
    w.load("m", 30)
    assert w.step() == []  # two maps are not "stays above"
    w.load("m", 30)
    got = w.step()
    scaled = [e for e in got if isinstance(e, m.ModelAutoscaled)]
    assert [(e.replicas, e.reason) for e in scaled] == [
        (6, "scaled up: 30.0 in flight per replica > 4 for 3 router ticks (3s)")]  # ceil(30/4) = 8, max 6
    assert len(placed(got)) == 5 and all(p.reason == scaled[0].reason for p in placed(got))
    assert w.state.models["m"].replicas_wanted == 6


def test_steady_load_never_flaps_and_quiet_scales_down_to_min_sparing_busy_replicas() -> None:
    w = autoscaled_world()
    for _ in range(3):
        w.load("m", 13)  # ceil(13 / 4) = 4
    w.healthy(w.step())
    assert len(w.running()) == 4
    decisions = []
    for i in range(60):  # a load that wobbles around the target: never a change
        w.load("m", 12 + i % 3)
        decisions += w.step()
    assert decisions == []
    # Quiet, but m-r1 still has a request in flight: the scale-down spares it.
    for _ in range(demand.DOWN_SAMPLES - 1):
        w.load("m", 0, busy={"m-r1": 1})
        assert w.step() == []
    w.load("m", 0, busy={"m-r1": 1})
    got = w.step()
    assert [(e.replicas) for e in got if isinstance(e, m.ModelAutoscaled)] == [1]
    assert sorted(x.replica_id for x in stopped(got)) == ["m-r2", "m-r3", "m-r4"]
    assert all(x.reason == "scaled down to 1" for x in stopped(got))
    assert w.running() == ["m-r1"]


def test_a_scale_down_never_stops_a_busy_replica_and_waits_for_one_to_go_quiet() -> None:
    w = autoscaled_world(min_replicas=0, max_replicas=2)
    for _ in range(3):
        w.load("m", 8)
    w.healthy(w.step())
    assert w.running() == ["m-r1", "m-r2"]
    for _ in range(demand.DOWN_SAMPLES):
        w.load("m", 2, busy={"m-r1": 1, "m-r2": 1})  # 2 in flight asks for 1 replica; both mid-request
    got = w.step()
    assert [e.replicas for e in got if isinstance(e, m.ModelAutoscaled)] == [1]
    assert stopped(got) == []
    w.load("m", 1, busy={"m-r1": 1})
    assert [x.replica_id for x in stopped(w.step())] == ["m-r2"]


def test_scale_to_zero_then_a_request_wakes_it() -> None:
    w = autoscaled_world(min_replicas=0)
    for _ in range(demand.DOWN_SAMPLES):
        w.load("m", 0)
    got = w.step()
    assert [e.replicas for e in got if isinstance(e, m.ModelAutoscaled)] == [0]
    assert w.running() == [] and w.state.model_states() == {"m": "parked"}
    w.wish("m", router="gw-b")
    got = w.step()
    woke = [e for e in got if isinstance(e, m.ModelAutoscaled)]
    assert [(e.replicas, e.reason) for e in woke] == [(1, "woken by gw-b: 1 request waiting")]
    assert [p.reason for p in placed(got)] == [woke[0].reason]
    w.healthy(got)
    # The thirty quiet maps before the wake say nothing about the new count: no flap back to zero.
    assert w.step() == []
    for _ in range(demand.UP_SAMPLES):
        w.load("m", 0, queued=7)  # maps that saw the wake, with requests still waiting: up to two
    assert [e.replicas for e in w.step() if isinstance(e, m.ModelAutoscaled)] == [2]


def test_a_model_scaled_to_zero_by_its_operator_stays_stopped() -> None:
    w = autoscaled_world(min_replicas=0)
    w.feed(m.ModelScaled(at=T0, name="m", replicas=0))
    w.step()
    w.wish("m")
    for _ in range(3):
        w.load("m", 0, queued=5)
    assert w.step() == []  # neither a wish nor load overrides the operator's 0
    assert w.state.model_states() == {"m": "stopped"}


def test_two_routers_and_a_restarted_one_wishing_at_once_make_one_placement() -> None:
    w = parked_world()
    w.wish("m", router="gw-a")
    w.wish("m", router="gw-b")
    w.feed(m.ModelWanted(at=T0, router="gw-a", boot_id="after-restart", model="m",
                         control_seq=w.seqs[subjects.STREAM_CONTROL]))
    got = placed(w.step(T0 + timedelta(seconds=63)))
    assert len(got) == 1
    w.wish("m", router="gw-b")  # still waiting while it starts: nothing more
    assert w.step(T0 + timedelta(seconds=64)) == []


def test_a_flood_of_wishes_for_made_up_models_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demand, "MAX_WISHES", 50)
    w = parked_world()
    for i in range(200):
        w.wish(f"made-up-{i}")
    assert len(w.memory.wished) == 50 and w.memory.ignored_wishes == 200
    w.wish("m")  # a declared model is always heard
    assert [p.replica_id for p in placed(w.step(T0 + timedelta(seconds=63)))] == ["m-r2"]


def test_a_redeploy_that_only_changes_the_plans_figures_restarts_nothing() -> None:
    w = World()
    w.feed(m.ModelDeclared(at=T0, spec=spec(kv_tokens=100_000)))
    w.healthy(w.step())
    w.feed(m.ModelDeclared(at=T0, spec=spec(kv_tokens=97_000)))  # the plan now says what the engine reserved
    assert w.step() == []


def scale_times(routers: int) -> tuple[int, int]:
    """Seconds from a load of 8 (target 4) to the scale-up, and from quiet to the scale-down, with ``routers``."""
    w = autoscaled_world(min_replicas=0, max_replicas=2)

    def tick(second: int, total: int) -> list[m.Event]:
        for r in range(routers):  # each router its share, a little apart within the second
            at = T0 + timedelta(seconds=1000 + second, milliseconds=150 * r)
            w.feed(m.IdleMapPublished(at=at, router=f"gw-{r}", boot_id="b", tick=second, tick_s=1.0,
                                      load={"m": m.ModelLoad(in_flight=total // routers + (r < total % routers))},
                                      control_seq=w.seqs[subjects.STREAM_CONTROL]))
        return [e for e in w.step() if isinstance(e, m.ModelAutoscaled)]

    assert [e for s in range(5) for e in tick(s, 4)] == []  # steady at the target: every router has reported
    up = next(s for s in range(5, 20) for e in tick(s, 8) if e.replicas == 2)
    down = next(s for s in range(up + 1, up + 60) for e in tick(s, 0) if e.replicas == 0)
    return up - 4, down - up


def test_the_windows_are_ticks_of_time_whatever_the_number_of_routers() -> None:
    """Several routers publish several maps a tick: up and down take as long with five as with one (to a tick:
    the first second of a change, some routers still report the old load)."""
    one = scale_times(1)
    assert one == (demand.UP_SAMPLES, demand.DOWN_SAMPLES)
    for routers in (3, 5):
        up, down = scale_times(routers)
        assert abs(up - one[0]) <= 1 and abs(down - one[1]) <= 1, (routers, up, down)


@pytest.mark.parametrize(("code", "reason", "parks"), [
    ("idle", "nobody asked for a long while", True),  # the code decides, whatever the words
    ("scaled_down", "idle: words that once meant idle", False),
    ("", "idle: no request for 900s (idle_ttl 600s)", True),  # written before codes: its wording's code
    ("", "scaled down to 0", False),
])
def test_the_memory_decides_on_a_stops_code_not_its_wording(code: str, reason: str, parks: bool) -> None:
    w = World()
    w.feed(m.ModelDeclared(at=T0, spec=spec()))
    w.healthy(w.step())
    (rid,) = w.running()
    before = w.memory.parked("m")
    w.feed(m.ReplicaStopped(at=T0, replica_id=rid, model="m", reason=reason, code=code))
    assert (w.memory.parked("m") > before) is parks
    assert m.ReplicaStopped(at=T0, replica_id=rid, model="m", reason=reason, code=code).stop_code == (
        code or ("idle" if parks else "scaled_down"))
