"""The pure scheduler: placement within one fabric, reasons, re-placement, back-off, idle ttl."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from llmgw import messages as m
from llmgw.fleet import demand
from llmgw.fleet.state import FleetState, apply
from llmgw.fleetfile import FleetNode, inventory
from llmgw.scheduler import placement as s

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def node(name: str, fabric: str, count: int, cls: str = "H100-80GB", unhealthy: tuple[int, ...] = ()) -> FleetNode:
    return FleetNode(name=name, fabric=fabric, gpu_class=cls, gpu_count=count, gpu_memory_mib=81559, unhealthy=unhealthy)


def spec(name: str = "m", tp: int = 1, pp: int = 1, replicas: int = 1, cls: str = "H100-80GB", context: int = 4096,
         **kw: object) -> m.ModelSpec:
    return m.ModelSpec(name=name, source="org/m", precision="bf16", engine="vllm", gpu_class=cls, context=context,
                       tp=tp, pp=pp, replicas=replicas, **kw)  # type: ignore[arg-type]


class World:
    """A fleet state and the scheduler's memory, folded the way the service folds them."""

    def __init__(self, *nodes: FleetNode) -> None:
        self.state = FleetState()
        self.memory = demand.SchedulerMemory()
        for n in nodes:
            self.feed(inventory(n, T0))

    def feed(self, event: m.Event) -> None:
        demand.observe(self.memory, event, self.state)
        apply(self.state, event)

    def step(self, now: datetime = T0) -> list[m.Event]:
        """Decide and fold the decisions back in, as the service does after they are stored."""
        events = [d.event for d in s.decide(self.state, self.memory, now)]
        for e in events:
            self.feed(e)
        return events


def placed(events: list[m.Event]) -> list[m.ReplicaPlaced]:
    return [e for e in events if isinstance(e, m.ReplicaPlaced)]


@pytest.mark.parametrize(
    ("nodes", "model", "want_nodes"),
    [
        # tp fits on the node with the fewest free GPUs that still fits (best fit).
        ([node("a1", "ib-a", 8), node("a2", "ib-a", 2)], spec(tp=2), [("a2",)]),
        # tp larger than any node: nothing, even though the fabric has enough in total.
        ([node("a1", "ib-a", 2), node("a2", "ib-a", 2)], spec(tp=4), []),
        # pp=2 takes two nodes of ONE fabric: ib-b has two, ib-a only one.
        ([node("a1", "ib-a", 8), node("b1", "ib-b", 4), node("b2", "ib-b", 4)], spec(tp=4, pp=2), [("b1", "b2")]),
        # pp=2 with one node per fabric never spans fabrics.
        ([node("a1", "ib-a", 8), node("b1", "ib-b", 8)], spec(tp=4, pp=2), []),
        # GPU class is respected.
        ([node("l1", "eth", 4, cls="L40S-48GB"), node("a1", "ib-a", 4)], spec(tp=2, cls="L40S-48GB"), [("l1",)]),
        # Unhealthy GPUs are neither used nor free: 4 GPUs, one bad, tp=4 does not fit.
        ([node("a1", "ib-a", 4, unhealthy=(1,))], spec(tp=4), []),
        # Two replicas spread across nodes when they can.
        ([node("a1", "ib-a", 4), node("a2", "ib-a", 4)], spec(tp=2, replicas=2), [("a1",), ("a2",)]),
    ],
)
def test_placement_table(nodes: list[FleetNode], model: m.ModelSpec, want_nodes: list[tuple[str, ...]]) -> None:
    w = World(*nodes)
    w.feed(m.ModelDeclared(at=T0, spec=model))
    got = placed(w.step())
    assert sorted(p.nodes for p in got) == sorted(want_nodes)
    for p in got:
        assert len(p.gpus) == model.tp * model.pp
        assert len({w.state.nodes[n].fabric for n in p.nodes}) == 1
        assert p.fabric == w.state.nodes[p.nodes[0]].fabric
        for g in p.gpus:
            gpu = w.state.nodes[g.node].gpus[g.index]
            assert gpu.uuid == g.uuid and gpu.healthy and gpu.gpu_class == model.gpu_class


def test_unplaceable_reason_names_each_fabric_and_next_step() -> None:
    b = node("h100-b-01", "ib-b", 1)
    w = World(node("h100-a-03", "ib-a", 2, unhealthy=(0,)), b)
    other = spec(name="other", tp=1)
    w.feed(m.ModelDeclared(at=T0, spec=other))
    w.feed(m.ReplicaPlaced(at=T0, replica_id="other-r1", model="other", nodes=(b.name,), spec=other,
                           gpus=(m.GpuRef(node=b.name, index=0, uuid=b.gpu_uuid(0)),), fabric="ib-b"))
    w.feed(m.ModelDeclared(at=T0, spec=spec(tp=2)))
    events = w.step()
    (u,) = [e for e in events if isinstance(e, m.ModelUnplaceable)]
    assert u.name == "m"
    assert u.reason == (
        "needs 2 × H100-80GB on one node (71.7 GiB on each GPU); fabric ib-a has 1 free on h100-a-03; fabric ib-b has none free; "
        "free cards with `llmgw ctl idle --stop` or choose a smaller plan candidate"
    )
    # The same reason is not published again on every pass.
    assert not [e for e in w.step() if isinstance(e, m.ModelUnplaceable)]


def test_unknown_gpu_class_reason_lists_classes() -> None:
    w = World(node("a1", "ib-a", 2))
    w.feed(m.ModelDeclared(at=T0, spec=spec(cls="B200-192GB")))
    (u,) = w.step()
    assert isinstance(u, m.ModelUnplaceable)
    assert "no node has B200-192GB GPUs (classes in the fleet: H100-80GB)" in u.reason


def test_retry_when_capacity_appears() -> None:
    w = World(node("a1", "ib-a", 1))
    w.feed(m.ModelDeclared(at=T0, spec=spec(tp=2)))
    assert isinstance(w.step()[0], m.ModelUnplaceable)
    w.feed(inventory(node("a2", "ib-a", 2), T0 + timedelta(seconds=5)))
    (p,) = placed(w.step(T0 + timedelta(seconds=5)))
    assert p.nodes == ("a2",)
    assert w.state.models["m"].unplaceable_reason is None


def test_replace_after_node_lost() -> None:
    w = World(node("a1", "ib-a", 2), node("a2", "ib-a", 2))
    w.feed(m.ModelDeclared(at=T0, spec=spec(tp=2)))
    (first,) = placed(w.step())
    w.feed(m.NodeLost(at=T0 + timedelta(seconds=60), node=first.nodes[0]))
    events = w.step(T0 + timedelta(seconds=61))
    assert [type(e).__name__ for e in events] == ["ReplicaStopped", "ReplicaPlaced"]
    stopped, again = events
    assert isinstance(stopped, m.ReplicaStopped) and isinstance(again, m.ReplicaPlaced)
    assert stopped.replica_id == first.replica_id and "lost" in stopped.reason
    assert again.replica_id != first.replica_id and again.nodes != first.nodes


def test_replace_after_gpu_unhealthy_keeps_healthy_neighbours() -> None:
    w = World(node("a1", "ib-a", 4))
    w.feed(m.ModelDeclared(at=T0, spec=spec(tp=2)))
    (first,) = placed(w.step())
    bad = first.gpus[1]
    # (An XID short of the fatal ones, which quarantine the whole node: tests/test_cordon.py.)
    w.feed(m.GpuHealthChanged(at=T0, node="a1", gpu_index=bad.index, gpu_uuid=bad.uuid, healthy=False, reasons=("xid 31",)))
    stopped, again = w.step()
    assert isinstance(stopped, m.ReplicaStopped) and "unhealthy: xid 31" in stopped.reason
    assert isinstance(again, m.ReplicaPlaced)
    assert bad.index not in {g.index for g in again.gpus}
    # The old replica's healthy GPU is free again and may be reused.
    assert len(again.gpus) == 2


def test_no_double_placement_across_many_models() -> None:
    w = World(node("a1", "ib-a", 8), node("a2", "ib-a", 8), node("b1", "ib-b", 8))
    for i, (tp, pp, n) in enumerate([(2, 1, 3), (4, 2, 1), (1, 1, 5), (8, 1, 1), (3, 1, 2)]):
        w.feed(m.ModelDeclared(at=T0, spec=spec(name=f"m{i}", tp=tp, pp=pp, replicas=n)))
    w.step()
    w.step()
    held = [(g.node, g.index) for r in w.state.replicas.values() for g in r.gpus]
    assert len(held) == len(set(held))
    assert len(held) <= 24


def test_scale_down_and_remove_stop_replicas() -> None:
    w = World(node("a1", "ib-a", 4))
    w.feed(m.ModelDeclared(at=T0, spec=spec(replicas=3)))
    assert len(placed(w.step())) == 3
    w.feed(m.ModelScaled(at=T0, name="m", replicas=1))
    stops = w.step()
    assert [type(e).__name__ for e in stops] == ["ReplicaStopped", "ReplicaStopped"]
    assert len(w.state.replicas) == 1
    w.feed(m.ModelRemoved(at=T0, name="m"))
    (last,) = w.step()
    assert isinstance(last, m.ReplicaStopped) and (last.code, last.reason) == ("removed", "model removed")
    assert not w.state.replicas


def test_failed_replica_backs_off() -> None:
    w = World(node("a1", "ib-a", 2))
    w.feed(m.ModelDeclared(at=T0, spec=spec()))
    (p,) = placed(w.step())
    w.feed(m.ReplicaStateChanged(at=T0, replica_id=p.replica_id, model="m", node="a1", state="failed", detail="CUDA out of memory"))
    (stopped,) = w.step(T0 + timedelta(seconds=1))
    assert isinstance(stopped, m.ReplicaStopped) and (stopped.code, stopped.reason) == ("engine_failed", "failed: CUDA out of memory")
    # Within the back-off nothing is placed; after it, one replica is.
    assert w.step(T0 + timedelta(seconds=1 + s.BACKOFF_BASE_S / 2)) == []
    assert len(placed(w.step(T0 + timedelta(seconds=1 + s.BACKOFF_BASE_S)))) == 1
    assert s.backoff_s(3) == 4 * s.BACKOFF_BASE_S and s.backoff_s(99) == s.BACKOFF_MAX_S


def test_idle_stopped_replica_stays_stopped_until_scaled() -> None:
    w = World(node("a1", "ib-a", 2))
    w.feed(m.ModelDeclared(at=T0, spec=spec()))
    (p,) = placed(w.step())
    w.feed(m.ReplicaStopped(at=T0, replica_id=p.replica_id, model="m", reason="idle"))
    assert w.step() == []
    w.feed(m.ModelScaled(at=T0, name="m", replicas=1))
    assert len(placed(w.step())) == 1


def test_idle_ttl_enforced_only_when_idle_is_known() -> None:
    w = World(node("a1", "ib-a", 2))
    w.feed(m.ModelDeclared(at=T0, spec=spec(idle_ttl_s=60.0)))
    (p,) = placed(w.step())
    # No router has said anything: unknown is not idle, however late it is.
    assert w.step(T0 + timedelta(hours=5)) == []
    w.feed(m.IdleMapPublished(at=T0, router="r1", boot_id="b", tick=1, last_request={p.replica_id: T0}))
    assert w.step(T0 + timedelta(seconds=30)) == []
    (stopped,) = w.step(T0 + timedelta(seconds=61))
    assert isinstance(stopped, m.ReplicaStopped) and stopped.reason.startswith("idle")
    assert w.step(T0 + timedelta(seconds=62)) == []


def test_two_deciders_on_the_same_history_agree() -> None:
    """Same history, same decisions, same msg ids: JetStream dedupes a second scheduler's copy."""
    a, b = World(node("a1", "ib-a", 4)), World(node("a1", "ib-a", 4))
    for w in (a, b):
        w.feed(m.ModelDeclared(at=T0, spec=spec(tp=2, replicas=2)))
    da = s.decide(a.state, a.memory, T0)
    db = s.decide(b.state, b.memory, T0)
    assert [d.msg_id for d in da] == [d.msg_id for d in db] == ["ReplicaPlaced:m-r1", "ReplicaPlaced:m-r2"]


def healthy(w: World, rid: str) -> None:
    w.feed(m.ReplicaStateChanged(at=T0, replica_id=rid, model=w.state.replicas[rid].model, node=w.state.replicas[rid].nodes[0],
                                 state="healthy", endpoint="http://x:1"))


def test_redeploy_rolls_without_going_offline() -> None:
    w = World(node("a1", "ib-a", 4))
    w.feed(m.ModelDeclared(at=T0, spec=spec()))
    (r1,) = placed(w.step())
    healthy(w, r1.replica_id)
    # Only the replica count or the idle TTL changed: nothing restarts.
    w.feed(m.ModelDeclared(at=T0, spec=spec(replicas=1, idle_ttl_s=60.0)))
    assert w.step() == []
    w.feed(m.ModelDeclared(at=T0, spec=spec(context=2048)))
    (r2,) = w.step()  # surge: the new one first, the old one keeps serving
    assert isinstance(r2, m.ReplicaPlaced) and r2.spec.context == 2048
    assert w.step() == []  # r2 not healthy yet: r1 stays
    healthy(w, r2.replica_id)
    (stopped,) = w.step()
    assert isinstance(stopped, m.ReplicaStopped) and stopped.replica_id == r1.replica_id
    assert (stopped.code, stopped.reason) == ("spec_changed", "spec changed: replaced by a replica of the new spec")


def test_redeploy_on_a_full_fleet_keeps_the_old_replica_serving_and_says_why() -> None:
    """Seen with a real vLLM: an in-place change on a full fleet stopped the only healthy replica at
    once, and the model served nothing for ~7 minutes. The default roll waits for room instead."""
    w = World(node("a1", "ib-a", 1))
    w.feed(m.ModelDeclared(at=T0, spec=spec()))
    (r1,) = placed(w.step())
    healthy(w, r1.replica_id)
    w.feed(m.ModelDeclared(at=T0, spec=spec(context=2048)))
    (waiting,) = w.step()
    assert isinstance(waiting, m.ModelUnplaceable) and waiting.missing_replicas == 1
    assert waiting.reason.startswith("spec changed, and no room for a replica of the new spec beside the old: ")
    assert "1 replica of the old spec keep serving" in waiting.reason and "--roll in-place" in waiting.reason
    assert w.step() == []  # said once; the old replica is still there
    assert list(w.state.replicas) == [r1.replica_id]
    # Room comes (a second node joins): the new replica starts beside the old, which then stops.
    w.feed(inventory(node("a2", "ib-a", 1), T0))
    (r2,) = placed(w.step())
    assert r2.nodes == ("a2",) and r2.spec.context == 2048
    healthy(w, r2.replica_id)
    (stopped,) = w.step()
    assert isinstance(stopped, m.ReplicaStopped) and stopped.replica_id == r1.replica_id


def test_redeploy_in_place_on_a_full_fleet_makes_room_when_asked() -> None:
    w = World(node("a1", "ib-a", 1))
    w.feed(m.ModelDeclared(at=T0, spec=spec()))
    (r1,) = placed(w.step())
    healthy(w, r1.replica_id)
    w.feed(m.ModelDeclared(at=T0, spec=spec(context=2048, roll="in-place")))
    (stopped,) = w.step()
    assert isinstance(stopped, m.ReplicaStopped)
    assert stopped.reason == "spec changed: stopped to make room for the new spec (roll in-place)"
    (r2,) = w.step()
    assert isinstance(r2, m.ReplicaPlaced) and r2.gpus == r1.gpus and r2.spec.context == 2048


def test_changing_only_how_a_model_rolls_restarts_nothing() -> None:
    w = World(node("a1", "ib-a", 1))
    w.feed(m.ModelDeclared(at=T0, spec=spec()))
    (r1,) = placed(w.step())
    healthy(w, r1.replica_id)
    w.feed(m.ModelDeclared(at=T0, spec=spec(roll="in-place")))
    assert w.step() == []


def _failed_b() -> World:
    """Models a (one replica) and b (two), one of b's failed and stopped: b backs off."""
    w = World(node("n1", "ib-a", 2), node("n2", "ib-a", 2))
    w.feed(m.ModelDeclared(at=T0, spec=spec("a")))
    w.feed(m.ModelDeclared(at=T0, spec=spec("b", replicas=2)))
    assert sorted(p.replica_id for p in placed(w.step())) == ["a-r1", "b-r1", "b-r2"]
    w.feed(m.ReplicaStateChanged(at=T0, replica_id="b-r1", model="b", node=w.state.replicas["b-r1"].nodes[0],
                                 state="failed", detail="CUDA out of memory"))
    (stopped,) = w.step(T0 + timedelta(seconds=1))
    assert isinstance(stopped, m.ReplicaStopped) and stopped.replica_id == "b-r1"
    assert w.memory.failures == {"b": 1}
    return w


def _node_of(w: World, rid: str, *, other: bool = False) -> str:
    mine = w.state.replicas[rid].nodes[0]
    return next(n for n in w.state.nodes if n != mine) if other else mine


@pytest.mark.parametrize(("replica", "node_of", "other_node", "cleared"), [
    ("b-r2", "b-r2", False, True),  # b's own replica, from its node: b is healthy again
    ("a-r1", "a-r1", False, False),  # a's replica named under model b (before: cleared b's back-off)
    ("b-r9", "b-r2", False, False),  # a replica nobody placed
    ("b-r2", "b-r2", True, False),  # b's replica, from a node it was not placed on
])
def test_only_a_models_own_replica_clears_its_back_off(replica: str, node_of: str, other_node: bool, cleared: bool) -> None:
    w = _failed_b()
    w.feed(m.ReplicaStateChanged(at=T0, replica_id=replica, model="b", node=_node_of(w, node_of, other=other_node),
                                 state="healthy", endpoint="http://x:1"))
    assert w.memory.failures == ({} if cleared else {"b": 1})
    assert ("b" in w.memory.failed_at) is not cleared
    # Within the back-off, b's missing replica waits; a cleared back-off places it at once.
    assert len(placed(w.step(T0 + timedelta(seconds=1 + s.BACKOFF_BASE_S / 2)))) == (1 if cleared else 0)


def test_a_failed_stop_counts_against_the_replicas_own_model_only() -> None:
    """A ReplicaStopped naming a's replica under model b must not back b off (nor a: it does not agree)."""
    w = _failed_b()
    w.feed(m.ReplicaStopped(at=T0, replica_id="a-r1", model="b", reason="failed: CUDA out of memory"))
    assert w.memory.failures == {"b": 1}


def test_unplaceable_says_why_as_a_code() -> None:
    """No GPU of the class anywhere is another answer than no room for one: analysts group by it."""
    for cls, code in (("B200-192GB", "no_such_class"), ("H100-80GB", "no_room")):
        w = World(node("n1", "ib", 1))
        w.feed(m.ModelDeclared(at=T0, spec=spec("big", tp=8, cls=cls)))
        (u,) = [e for e in w.step() if isinstance(e, m.ModelUnplaceable)]
        assert u.code == code, u.reason
