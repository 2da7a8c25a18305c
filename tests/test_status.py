"""The pure status report: capacity, free whole nodes, unplaceable, idle; time is an argument."""

from __future__ import annotations

from projection_events import inventory, placed, small_fleet, spec, t

from llmgw import messages as m
from llmgw.fleet.state import fold
from llmgw.fleet.status import UNKNOWN_IDLE, report


def test_capacity_counts_unhealthy_and_lost_as_neither_used_nor_free() -> None:
    r = report(fold(small_fleet()))
    h100, l40s = 81559, 46068
    assert r.capacity == (
        m.ClassCapacity(gpu_class="H100-80GB", total=16, used=9, free=2, unhealthy=1, lost=4, memory_mib=11 * h100,
                        booked_mib=9 * h100, free_mib=2 * h100, most_free_mib=h100),
        m.ClassCapacity(gpu_class="L40S-48GB", total=2, used=1, free=1, unhealthy=0, lost=0, memory_mib=2 * l40s,
                        booked_mib=l40s, free_mib=l40s, most_free_mib=l40s),
    )
    for c in r.capacity:
        assert c.used + c.free + c.unhealthy + c.lost == c.total
        assert c.booked_mib + c.free_mib == c.memory_mib


def shared_card() -> list[m.Event]:
    """One node of two 16 GiB cards; three small llama.cpp replicas booked on card 0, one reporting its use."""
    card = 16 * 1024
    node = m.NodeInventoryReported(at=t(0), node="l4", fabric="pcie", fabric_source="fleet-file", boot_id="b",
                                   simulated=True, gpus=tuple(m.GpuInfo(index=i, uuid=f"GPU-l4-{i}", name="NVIDIA L4",
                                                                        gpu_class="L4-16GB", memory_mib=card)
                                                              for i in range(2)))
    events: list[m.Event] = [node]
    for name, mib in (("a", 1331), ("b", 2048), ("c", 512)):
        s = m.ModelSpec(name=name, source=f"./models/{name}", precision="q8_0", engine="llama.cpp",
                        gpu_class="L4-16GB", context=2048, gib_per_gpu=round(mib / 1024, 2))
        events += [m.ModelDeclared(at=t(1), spec=s),
                   m.ReplicaPlaced(at=t(2), replica_id=f"{name}-r1", model=name, nodes=("l4",), fabric="pcie", spec=s,
                                   gpus=(m.GpuRef(node="l4", index=0, uuid="GPU-l4-0", mib=mib),))]
    events.append(m.ReplicaStateChanged(at=t(3), replica_id="b-r1", model="b", node="l4", state="healthy",
                                        observed_memory_mib=1900))
    return events


def test_memory_per_class_is_booked_used_and_free_on_shared_cards() -> None:
    r = report(fold(shared_card()), replicas=True)
    (c,) = r.capacity
    # One card holds three replicas (not a free whole GPU); the other is whole and free.
    assert (c.total, c.used, c.free) == (2, 1, 1)
    assert (c.memory_mib, c.booked_mib, c.free_mib, c.most_free_mib) == (32768, 3891, 32768 - 3891, 16384)
    assert c.used_mib == 1900  # what b's engine reports; a and c report nothing yet
    (held,) = r.gpu_bookings
    assert (held.node, held.index, held.booked_mib, held.memory_mib) == ("l4", 0, 3891, 16384)
    assert held.replicas == (("a-r1", 1331), ("b-r1", 2048), ("c-r1", 512))
    assert {row.replica_id: row.booked_mib for row in r.replica_list} == {
        "a-r1": {"l4": 1331}, "b-r1": {"l4": 2048}, "c-r1": {"l4": 512}}


def test_free_whole_nodes_per_fabric() -> None:
    events = [
        inventory("a1", "ib-a", 4, t(0)),
        inventory("a2", "ib-a", 4, t(0)),
        inventory("a3", "ib-a", 4, t(0), unhealthy=(1,)),
        inventory("b1", "ib-b", 4, t(0)),
        placed("r1", spec("m"), [("a1", 0)], t(1)),
        m.NodeLost(at=t(2), node="b1"),
    ]
    assert report(fold(events)).free_nodes == (
        m.FabricNodes(fabric="ib-a", gpu_class="H100-80GB", free_nodes=1, live_nodes=3),
        m.FabricNodes(fabric="ib-b", gpu_class="H100-80GB", free_nodes=0, live_nodes=0),
    )


def test_idle_sorted_by_gpu_seconds_and_unknown_last() -> None:
    big, small = spec("big", tp=8), spec("small")
    events = [
        placed("r-big", big, [("n1", i) for i in range(8)], t(0)),
        placed("r-small", small, [("n2", 0)], t(0)),
        placed("r-new", small, [("n2", 1)], t(0)),
        placed("r-dunno", big, [("n3", i) for i in range(8)], t(0)),
        m.ReplicaStateChanged(at=t(1), replica_id="r-dunno", model="big", node="n3", state="healthy",
                              endpoint="http://n3:8000"),
        # Placed a minute ago, starting, and no router knows it: nobody could have asked it, so it is not
        # listed (r-dunno, unknown for five hours, is).
        placed("r-starting", small, [("n2", 2)], t(299)),
        m.ReplicaStateChanged(at=t(299), replica_id="r-starting", model="small", node="n2", state="starting"),
        # r-small idle 5 h × 1 GPU, r-big idle 1 h × 8 GPUs: r-big first.
        m.IdleMapPublished(at=t(300), router="a", boot_id="a", tick=1,
                           last_request={"r-big": t(240), "r-small": t(0), "r-new": t(290)}),
    ]
    r = report(fold(events), None, 1800)
    assert [(i.replica_id, i.idle_s) for i in r.idle] == [("r-big", 3600.0), ("r-small", 18000.0), ("r-dunno", UNKNOWN_IDLE)]
    assert r.unknown_idle == 1
    assert r.idle[0].idle_since == t(240)


def test_now_is_an_argument() -> None:
    state = fold(small_fleet())
    later = report(state, t(200), 1800)
    assert later.now == t(200)
    assert [(i.replica_id, i.idle_s) for i in later.idle] == [
        ("r-llama", 105 * 60.0), ("r-qwen", 192 * 60.0), ("r-gemma", UNKNOWN_IDLE)]
    # The state was not changed by asking.
    assert report(state) == report(fold(small_fleet()))


def test_unplaceable_and_counts() -> None:
    r = report(fold(small_fleet()))
    assert [u.name for u in r.unplaceable] == ["deepseek-v3"]
    assert (r.nodes, r.lost_nodes, r.models, r.replicas) == (5, ("n5",), 4, 3)
    assert r.replicas_by_state == {"healthy": 2, "starting": 1}


def test_empty_fleet() -> None:
    r = report(fold([]))
    assert (r.now, r.capacity, r.idle, r.nodes) == (None, (), (), 0)
