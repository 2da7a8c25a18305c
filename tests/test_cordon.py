"""Node maintenance: cordon (nothing new), drain (moved off as a roll), uncordon, and quarantine after fatal XIDs."""

from __future__ import annotations

from datetime import timedelta

import pytest
from test_cli_sharing import control, ctl, publish
from test_scheduler import T0, World, node, placed, spec

from llmgw import fleetfile
from llmgw import messages as m
from llmgw.config import Settings


def healthy(w: World, events: list[m.Event]) -> None:
    for e in placed(events):
        w.feed(m.ReplicaStateChanged(at=T0, replica_id=e.replica_id, model=e.model, node=e.nodes[0],
                                     state="healthy", endpoint="http://x"))


def test_a_cordoned_node_takes_nothing_new_and_keeps_what_runs() -> None:
    w = World(node("a", "ib", 2), node("b", "ib", 2))
    w.feed(m.ModelDeclared(at=T0, spec=spec(name="x", exclusive=True)))
    (first,) = placed(w.step())
    w.feed(m.NodeCordoned(at=T0, node=first.nodes[0], reason="fan"))
    w.feed(m.ModelScaled(at=T0, name="x", replicas=3))
    events = w.step()
    assert {e.nodes[0] for e in placed(events)} == {"b" if first.nodes[0] == "a" else "a"}
    assert first.replica_id in w.state.replicas  # what ran there still runs
    w.feed(m.NodeUncordoned(at=T0, node=first.nodes[0]))
    w.feed(m.ModelScaled(at=T0, name="x", replicas=4))
    assert {e.nodes[0] for e in placed(w.step())} == {first.nodes[0]}


def test_a_drained_node_is_emptied_one_replica_at_a_time_each_new_one_healthy_first() -> None:
    w = World(node("a", "ib", 2), node("b", "ib", 2))
    w.feed(m.ModelDeclared(at=T0, spec=spec(name="x", replicas=2, exclusive=True)))
    healthy(w, w.step())
    on_a = sorted(r.replica_id for r in w.state.replicas.values() if r.nodes == ("a",))
    assert on_a
    w.feed(m.NodeCordoned(at=T0, node="a", drain=True))
    events = w.step()
    assert all(e.nodes == ("b",) for e in placed(events)) and placed(events)
    assert not [e for e in events if isinstance(e, m.ReplicaStopped)]  # nothing stops before its successor is healthy
    healthy(w, events)
    stops = [e for e in w.step() if isinstance(e, m.ReplicaStopped)]
    assert sorted(e.replica_id for e in stops) == on_a and {e.code for e in stops} == {"drained"}
    assert all("draining a: replaced by a replica elsewhere" in e.reason for e in stops)
    assert not any(r.nodes == ("a",) for r in w.state.replicas.values())


def test_a_node_that_loses_a_gpu_to_xid_79_is_quarantined_and_gets_no_more_replicas() -> None:
    w = World(node("bad", "ib", 4), node("ok", "ib", 4))
    w.feed(m.ModelDeclared(at=T0, spec=spec(name="coder", exclusive=True)))
    w.step()
    gpu = w.state.nodes["bad"].gpus[3]
    w.feed(m.GpuHealthChanged(at=T0, node="bad", gpu_index=3, gpu_uuid=gpu.uuid, healthy=False,
                              reasons=("xid 79: GPU has fallen off the bus",)))
    w.feed(m.ModelScaled(at=T0, name="coder", replicas=4))
    events = w.step(T0 + timedelta(seconds=1))
    (q,) = [e for e in events if isinstance(e, m.NodeCordoned)]
    assert q.node == "bad" and q.by == "quarantine" and "xid 79" in q.reason
    assert all(e.nodes == ("ok",) for e in placed(events))  # not in the pass that quarantined it either
    assert not [e for e in w.step(T0 + timedelta(seconds=2)) if isinstance(e, m.NodeCordoned)]  # once


def test_an_xid_that_is_not_fatal_quarantines_nothing() -> None:
    w = World(node("a", "ib", 2))
    gpu = w.state.nodes["a"].gpus[0]
    w.feed(m.GpuHealthChanged(at=T0, node="a", gpu_index=0, gpu_uuid=gpu.uuid, healthy=False,
                              reasons=("xid 31: GPU memory page fault",)))
    assert not [e for e in w.step() if isinstance(e, m.NodeCordoned)]


@pytest.fixture
def fleet_events() -> list[m.Event]:
    return [fleetfile.inventory(node("h100-a-03", "ib-a", 2), T0)]


def test_ctl_node_cordon_drain_uncordon(settings: Settings, fleet_events: list[m.Event]) -> None:
    publish(settings, fleet_events, fresh=True)
    out = ctl(settings, "ctl", "node", "drain", "h100-a-03", "--reason", "BIOS update")
    assert out.exit_code == 0 and "draining h100-a-03: nothing new is placed on it" in out.output, out.output
    (c,) = [e for e in control(settings) if isinstance(e, m.NodeCordoned)]
    assert (c.node, c.drain, c.reason, c.by) == ("h100-a-03", True, "BIOS update", "operator")
    shown = ctl(settings, "ctl", "status", "--replay")
    assert "node h100-a-03: draining: BIOS update" in shown.output
    assert ctl(settings, "ctl", "node", "uncordon", "h100-a-03").exit_code == 0
    again = ctl(settings, "ctl", "node", "uncordon", "h100-a-03")
    assert again.exit_code == 1 and "is not cordoned" in again.output
    missing = ctl(settings, "ctl", "node", "cordon", "nothere")
    assert missing.exit_code == 1 and "no node named 'nothere'" in missing.output


def test_an_uncordon_after_a_quarantine_is_an_operators_look_and_holds() -> None:
    w = World(node("bad", "ib", 2))
    gpu = w.state.nodes["bad"].gpus[1]
    w.feed(m.GpuHealthChanged(at=T0, node="bad", gpu_index=1, gpu_uuid=gpu.uuid, healthy=False,
                              reasons=("xid 48: double-bit ECC error",)))
    assert [e for e in w.step(T0 + timedelta(seconds=1)) if isinstance(e, m.NodeCordoned)]
    w.feed(m.NodeUncordoned(at=T0 + timedelta(seconds=2), node="bad"))
    assert not [e for e in w.step(T0 + timedelta(seconds=3)) if isinstance(e, m.NodeCordoned)]
