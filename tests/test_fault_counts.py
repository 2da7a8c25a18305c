"""GPU faults counted per UUID: quarantine after N in M minutes, and placement that prefers fewer recent faults."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

from test_cli_sharing import ctl, publish
from test_scheduler import T0, World, node, placed, spec

from llmgw import fleetfile
from llmgw import messages as m
from llmgw.config import Settings
from llmgw.fleet.state import FAULT_DAYS, FAULTS_KEPT
from llmgw.scheduler import Quarantine, decide


def fault(w: World, name: str, index: int, at: datetime, why: str = "xid 31: GPU memory page fault") -> None:
    """The GPU goes unhealthy at ``at`` and is healthy again a second later (a fault that clears)."""
    uuid = w.state.nodes[name].gpus[index].uuid
    w.feed(m.GpuHealthChanged(at=at, node=name, gpu_index=index, gpu_uuid=uuid, healthy=False, reasons=(why,)))
    w.feed(m.GpuHealthChanged(at=at + timedelta(seconds=1), node=name, gpu_index=index, gpu_uuid=uuid, healthy=True))


def cordons(events: list[m.Event]) -> list[m.NodeCordoned]:
    return [e for e in events if isinstance(e, m.NodeCordoned)]


def test_the_fold_counts_each_gpus_faults_by_uuid_through_inventories_and_forgets_old_ones() -> None:
    w = World(node("a", "ib", 2))
    uuid = w.state.nodes["a"].gpus[0].uuid
    fault(w, "a", 0, T0)
    w.feed(fleetfile.inventory(node("a", "ib", 2), T0 + timedelta(minutes=1)))  # rebuilds the GpuViews
    w.feed(m.GpuHealthChanged(at=T0 + timedelta(minutes=2), node="a", gpu_index=0, gpu_uuid=uuid, healthy=False,
                              reasons=("xid 13",)))
    # Unhealthy for another reason is the same fault, not a new one.
    w.feed(m.GpuHealthChanged(at=T0 + timedelta(minutes=3), node="a", gpu_index=0, gpu_uuid=uuid, healthy=False,
                              reasons=("xid 13", "xid 31")))
    assert w.state.faults == {uuid: [T0, T0 + timedelta(minutes=2)]}
    later = T0 + timedelta(days=FAULT_DAYS, minutes=10)
    other = w.state.nodes["a"].gpus[1].uuid
    fault(w, "a", 1, later)
    assert w.state.faults == {other: [later]}  # a week on, the first GPU's are forgotten
    for i in range(FAULTS_KEPT + 5):
        fault(w, "a", 1, later + timedelta(minutes=i + 1))
    assert len(w.state.faults[other]) == FAULTS_KEPT


def test_n_faults_in_m_minutes_quarantine_a_node_once_until_an_operator_looks() -> None:
    w = World(node("flaky", "ib", 4), node("ok", "ib", 4))
    fault(w, "flaky", 0, T0)
    fault(w, "flaky", 2, T0 + timedelta(minutes=20))
    assert not cordons(w.step(T0 + timedelta(minutes=21)))  # two: not yet
    fault(w, "flaky", 0, T0 + timedelta(minutes=40))
    (q,) = cordons(w.step(T0 + timedelta(minutes=41)))
    assert q.node == "flaky" and q.by == "quarantine"
    assert "3 GPU faults in 60 min (GPU 0 ×2, GPU 2 ×1" in q.reason and "ctl node uncordon flaky" in q.reason
    assert not cordons(w.step(T0 + timedelta(minutes=42)))  # once
    w.feed(m.NodeUncordoned(at=T0 + timedelta(minutes=43), node="flaky"))
    assert not cordons(w.step(T0 + timedelta(minutes=44)))  # the operator looked at those three
    for i in range(3):
        fault(w, "flaky", 1, T0 + timedelta(minutes=45 + i))
    (again,) = cordons(w.step(T0 + timedelta(minutes=50)))
    assert "3 GPU faults in 60 min (GPU 1 ×3" in again.reason


def test_faults_spread_wider_than_the_window_or_a_zero_limit_quarantine_nothing() -> None:
    w = World(node("a", "ib", 2))
    for i in range(3):
        fault(w, "a", 0, T0 + timedelta(minutes=40 * i))
    assert not cordons(w.step(T0 + timedelta(minutes=81)))  # never three inside one hour of now
    fault(w, "a", 1, T0 + timedelta(minutes=82))
    now = T0 + timedelta(minutes=83)
    assert not cordons([d.event for d in decide(w.state, w.memory, now, Quarantine(faults=0))])
    assert not cordons([d.event for d in decide(w.state, w.memory, now, Quarantine(faults=5, window_s=86400))])
    (q,) = cordons([d.event for d in decide(w.state, w.memory, now, Quarantine(faults=4, window_s=86400))])
    assert "4 GPU faults in 1440 min" in q.reason


def test_placement_prefers_the_node_and_the_gpus_with_fewer_recent_faults() -> None:
    w = World(node("a", "ib", 2), node("b", "ib", 2))
    fault(w, "a", 0, T0)
    w.feed(m.ModelDeclared(at=T0, spec=spec(name="x", exclusive=True)))
    (first,) = placed(w.step(T0 + timedelta(minutes=1)))
    assert first.nodes == ("b",)  # same free GPUs: the one with no fault (by name, "a" came first)
    w.feed(m.ModelDeclared(at=T0, spec=spec(name="y", exclusive=True, replicas=2)))
    ys = placed(w.step(T0 + timedelta(minutes=2)))
    on_a = [g.index for e in ys for g in e.gpus if g.node == "a"]
    assert on_a == [1]  # within a node, the GPU that never faulted first


def test_ctl_status_shows_each_nodes_gpu_faults_in_the_last_day(settings: Settings) -> None:
    inv = fleetfile.inventory(node("h100-a-03", "ib-a", 2), T0)
    uuid = inv.gpus[1].uuid
    now = m.utcnow()
    events: list[m.Event] = [fleetfile.inventory(node("h100-a-03", "ib-a", 2), now)]
    for i in range(2):
        at = now + timedelta(seconds=i * 2)
        events += [m.GpuHealthChanged(at=at, node="h100-a-03", gpu_index=1, gpu_uuid=uuid, healthy=False,
                                      reasons=("xid 31",)),
                   m.GpuHealthChanged(at=at + timedelta(seconds=1), node="h100-a-03", gpu_index=1, gpu_uuid=uuid,
                                      healthy=True)]
    publish(settings, events, fresh=True)
    out = ctl(settings, "ctl", "status", "--replay", "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["gpu_faults"] == {"h100-a-03": 2}
    text = ctl(settings, "ctl", "status", "--replay")
    assert "node h100-a-03: 2 GPU faults in 24h" in text.output, text.output


def _swept_every_time(faults: dict[str, list[datetime]], uuid: str, at: datetime) -> None:
    """record_fault as it was: every GPU's list swept at every fault (the reference it must still equal)."""
    times = faults.setdefault(uuid, [])
    times.append(at)
    if len(times) > FAULTS_KEPT:
        del times[: len(times) - FAULTS_KEPT]
    cutoff = at - timedelta(days=FAULT_DAYS)
    for key in list(faults):
        kept = [t for t in faults[key] if t > cutoff]
        if not kept:
            del faults[key]
        elif len(kept) < len(faults[key]):
            faults[key] = kept


def test_the_faults_kept_are_those_of_a_sweep_at_every_fault_out_of_order_trimmed_and_resumed() -> None:
    import random

    from llmgw.fleet.fold import Checkpoint, decode_state, encode
    from llmgw.fleet.state import FleetState, record_fault

    rng = random.Random(46)
    state, reference = FleetState(), {}
    trimmed = forgotten = 0
    at = T0
    for i in range(3000):
        # Mostly forward, sometimes back (publishers' clocks), bursts on one card (trimmed at FAULTS_KEPT),
        # and gaps longer than FAULT_DAYS that make everything go.
        at += timedelta(minutes=rng.choice((0.1, 1, 5, 90)) * rng.random())
        if rng.random() < 0.002:
            at += timedelta(days=FAULT_DAYS + 1)
        when = at - timedelta(days=rng.random() * 8) if rng.random() < 0.1 else at
        uuid = "GPU-hot" if rng.random() < 0.3 else f"GPU-{rng.randrange(40)}"
        before = sum(map(len, reference.values()))
        record_fault(state, uuid, when)
        _swept_every_time(reference, uuid, when)
        assert state.faults == reference, i
        trimmed += len(reference.get(uuid, ())) == FAULTS_KEPT
        forgotten += sum(map(len, reference.values())) <= before
        if i % 700 == 350:  # resumed from a checkpoint: the map is a new object, measured afresh
            state = decode_state(encode(Checkpoint(state=state))).state
        if i == 2000:  # or replaced wholesale, by a map with a fault in it that the next one makes go
            reference["GPU-old"] = [when - timedelta(days=FAULT_DAYS, hours=1)]
            state.faults = {k: list(v) for k, v in reference.items()}
            record_fault(state, "GPU-hot", when)
            _swept_every_time(reference, "GPU-hot", when)
            assert state.faults == reference and "GPU-old" not in reference
    assert trimmed and forgotten > trimmed  # both ways of forgetting were exercised
