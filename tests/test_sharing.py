"""GPUs shared by memory: a replica books what its plan needs on each GPU, and placement packs.

The pure scheduler and fold, as ``test_scheduler`` drives them: every decision folded
back in as the service does once it is stored.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import T0, World, node, placed

from llmgw import messages as m
from llmgw.fleet.state import FleetState, booking_mib
from llmgw.fleetfile import FleetNode
from llmgw.scheduler import placement as s

CARD_MIB = 16 * 1024


def card(name: str, fabric: str = "pcie") -> FleetNode:
    return FleetNode(name=name, fabric=fabric, gpu_class="L4-16GB", gpu_count=1, gpu_memory_mib=CARD_MIB)


def small(name: str, gib: float, **kw: object) -> m.ModelSpec:
    """A llama.cpp model whose plan charges ``gib`` per GPU (weights + KV at its context + buffers)."""
    fields: dict[str, object] = {"context": 2048, **kw}
    return m.ModelSpec(name=name, source=f"./models/{name}", precision="q8_0", engine="llama.cpp",
                       gpu_class="L4-16GB", gib_per_gpu=gib, **fields)  # type: ignore[arg-type]


def overbooked(state: FleetState) -> list[str]:
    """Every GPU booked past its memory, and every exclusive replica that is not alone on its GPU."""
    bad = []
    who = state.gpu_replicas()
    for (name, index), mib in state.booked().items():
        gpu = state.nodes[name].gpus.get(index) if name in state.nodes else None
        if gpu is not None and mib > gpu.memory_mib:
            bad.append(f"{name}/{index}: {mib} MiB booked of {gpu.memory_mib}")
    for r in state.replicas.values():
        if r.spec.exclusive:
            for g in r.gpus:
                if len(who[(g.node, g.index)]) > 1:
                    bad.append(f"{r.replica_id} is exclusive and shares {g.node}/{g.index}")
    return bad


def test_twenty_small_models_share_four_cards_and_leave_two_whole_for_a_large_one() -> None:
    w = World(*(card(f"n{i}") for i in range(2)), FleetNode(name="n2", fabric="pcie", gpu_class="L4-16GB",
                                                            gpu_count=2, gpu_memory_mib=CARD_MIB))
    sizes = [0.3, 0.5, 0.8, 1.2, 1.6]  # demo models of several sizes, each with its KV and buffers
    for i in range(20):
        w.feed(m.ModelDeclared(at=T0, spec=small(f"s{i}", sizes[i % len(sizes)])))
    events = w.step()
    got = placed(events)
    assert len(got) == 20 and not [e for e in events if isinstance(e, m.ModelUnplaceable)]
    assert not overbooked(w.state)
    # Packed: 20 x 0.88 GiB on average is ~17.6 GiB, more than one card and far less than four.
    used = Counter((g.node, g.index) for e in got for g in e.gpus)
    assert len(used) == 2, used
    assert all(g.mib == booking_mib(e.spec, CARD_MIB) for e in got for g in e.gpus)
    # A two-card model declared after them finds two whole cards on one node: the holes were kept.
    w.feed(m.ModelDeclared(at=T0, spec=small("big", 14.0, tp=2, exclusive=True)))
    (big,) = placed(w.step())
    assert big.nodes == ("n2",) and {g.index for g in big.gpus} == {0, 1}
    assert all(g.mib == CARD_MIB for g in big.gpus)
    assert not overbooked(w.state)


def test_whole_card_placement_serves_only_as_many_models_as_cards() -> None:
    w = World(*(card(f"n{i}") for i in range(4)))
    for i in range(20):
        w.feed(m.ModelDeclared(at=T0, spec=small(f"s{i}", 0.5, exclusive=True)))
    events = w.step()
    assert len(placed(events)) == 4
    unplaceable = [e for e in events if isinstance(e, m.ModelUnplaceable)]
    assert len(unplaceable) == 16
    assert "needs 1 × L4-16GB on one node; fabric pcie has none free" in unplaceable[0].reason


def test_a_small_replica_goes_to_the_tightest_gpu_it_fits_before_an_empty_one() -> None:
    w = World(card("a"), card("b"), card("c"))
    w.feed(m.ModelDeclared(at=T0, spec=small("x", 10.0)))
    w.feed(m.ModelDeclared(at=T0, spec=small("y", 13.0)))
    w.step()
    # x leaves 6 GiB on its card, y 3 GiB: a 2.5 GiB replica goes beside y, a 5 GiB one beside x.
    w.feed(m.ModelDeclared(at=T0, spec=small("p", 2.5)))
    w.feed(m.ModelDeclared(at=T0, spec=small("q", 5.0)))
    w.step()
    on = {r.model: r.nodes[0] for r in w.state.replicas.values()}
    assert on["p"] == on["y"] and on["q"] == on["x"]
    assert len({on["x"], on["y"]}) == 2
    # Nothing fits beside them any more: a 4 GiB one takes the empty card.
    w.feed(m.ModelDeclared(at=T0, spec=small("r", 4.0)))
    w.step()
    on = {r.model: r.nodes[0] for r in w.state.replicas.values()}
    assert on["r"] not in {on["x"], on["y"]}


def test_an_unplaceable_small_model_is_told_the_gib_it_is_short_on_the_best_gpu() -> None:
    w = World(card("a"))
    w.feed(m.ModelDeclared(at=T0, spec=small("x", 12.0)))
    w.step()
    w.feed(m.ModelDeclared(at=T0, spec=small("y", 6.0)))
    (u,) = [e for e in w.step() if isinstance(e, m.ModelUnplaceable)]
    assert "needs 1 × L4-16GB on one node (6.0 GiB on each GPU)" in u.reason
    assert "the most free on one GPU is 4.0 GiB (GPU 0 on a), 2.0 GiB short" in u.reason


def test_a_vllm_replica_books_its_utilization_of_the_card() -> None:
    spec = m.ModelSpec(name="v", source="org/v", precision="bf16", engine="vllm", gpu_class="L4-16GB", context=2048,
                       gpu_memory_utilization=0.3, gib_per_gpu=4.8)
    assert booking_mib(spec, CARD_MIB) == round(0.3 * CARD_MIB + 0.5)
    assert booking_mib(msgspec.structs.replace(spec, exclusive=True), CARD_MIB) == CARD_MIB
    # A spec declared before plans carried a figure books the whole card.
    assert booking_mib(small("old", 0.0), CARD_MIB) == CARD_MIB
    w = World(card("a"))
    for name in ("v1", "v2", "v3"):
        w.feed(m.ModelDeclared(at=T0, spec=msgspec.structs.replace(spec, name=name)))
    events = w.step()
    assert len(placed(events)) == 3 and not overbooked(w.state)  # 3 x 0.3 of the card
    w.feed(m.ModelDeclared(at=T0, spec=msgspec.structs.replace(spec, name="v4")))
    assert [e for e in w.step() if isinstance(e, m.ModelUnplaceable)]


def test_an_unhealthy_gpu_replaces_every_replica_on_it() -> None:
    w = World(card("a"), card("b"))
    for i in range(3):
        w.feed(m.ModelDeclared(at=T0, spec=small(f"s{i}", 1.0)))
    w.step()
    (where,) = {r.nodes[0] for r in w.state.replicas.values()}
    gpu = w.state.nodes[where].gpus[0]
    w.feed(m.GpuHealthChanged(at=T0, node=where, gpu_index=0, gpu_uuid=gpu.uuid, healthy=False, reasons=("XID 79",)))
    events = w.step(T0 + timedelta(seconds=1))
    assert sorted(e.model for e in events if isinstance(e, m.ReplicaStopped)) == ["s0", "s1", "s2"]
    assert {e.nodes[0] for e in placed(events)} == {"b" if where == "a" else "a"}


def test_a_roll_starts_the_new_replica_beside_the_old_on_a_one_gpu_fleet() -> None:
    w = World(card("a"))
    w.feed(m.ModelDeclared(at=T0, spec=small("x", 4.0)))
    w.step()
    w.feed(m.ModelDeclared(at=T0, spec=small("x", 4.0, context=4096)))
    events = w.step()
    (new,) = placed(events)
    assert new.nodes == ("a",) and not [e for e in events if isinstance(e, m.ReplicaStopped)]
    assert len(w.state.gpu_replicas()[("a", 0)]) == 2  # the old one serves until the new is healthy


# --- no GPU is ever booked past its memory, whatever happens ---------------------------------------

STEP = st.one_of(
    st.tuples(st.just("declare"), st.integers(0, 7), st.sampled_from([0.5, 1.5, 3.0, 7.0, 15.0]),
              st.sampled_from([1, 1, 1, 2]), st.booleans(), st.integers(1, 4)),
    st.tuples(st.just("scale"), st.integers(0, 7), st.integers(0, 5)),
    st.tuples(st.just("stop"), st.integers(0, 30)),
    st.tuples(st.just("xid"), st.integers(0, 2), st.integers(0, 1), st.booleans()),
    st.tuples(st.just("remove"), st.integers(0, 7)),
)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(STEP, min_size=1, max_size=25))
def test_no_gpu_is_ever_booked_past_its_memory(steps: list[tuple[object, ...]]) -> None:
    nodes = [node(f"n{i}", "ib-a", 2, cls="L4-16GB") for i in range(3)]
    nodes = [msgspec.structs.replace(n, gpu_memory_mib=CARD_MIB) for n in nodes]
    w = World(*nodes)
    now = T0
    for step in steps:
        now += timedelta(seconds=1)
        match step:
            case ("declare", i, gib, tp, exclusive, replicas):
                spec = small(f"m{i}", gib, tp=tp, exclusive=exclusive, replicas=replicas)
                w.feed(m.ModelDeclared(at=now, spec=spec))
            case ("scale", i, replicas) if f"m{i}" in w.state.models:
                w.feed(m.ModelScaled(at=now, name=f"m{i}", replicas=replicas))
            case ("stop", k) if w.state.replicas:
                r = sorted(w.state.replicas.values(), key=lambda r: r.replica_id)[k % len(w.state.replicas)]
                w.feed(m.ReplicaStopped(at=now, replica_id=r.replica_id, model=r.model, reason="stopped"))
            case ("xid", n, g, healthy):
                gpu = w.state.nodes[f"n{n}"].gpus[g]
                w.feed(m.GpuHealthChanged(at=now, node=f"n{n}", gpu_index=g, gpu_uuid=gpu.uuid, healthy=healthy,
                                          reasons=() if healthy else ("XID 79",)))
            case ("remove", i) if f"m{i}" in w.state.models:
                w.feed(m.ModelRemoved(at=now, name=f"m{i}"))
        # The scheduler's pass, each of its events folded one by one and the fold checked after each.
        for decision in s.decide(w.state, w.memory, now):
            w.feed(decision.event)
            assert not overbooked(w.state), decision.event
        for r in w.state.replicas.values():  # and nothing is left on a GPU that is unhealthy
            assert all(w.state.nodes[g.node].gpus[g.index].healthy for g in r.gpus), r.replica_id
