"""``ctl status`` after a replica stops: its GPU's NVML memory from a heartbeat taken before the stop is not shown
as in use (issue 43: it was, until the node's next heartbeat)."""

from __future__ import annotations

from projection_events import inventory, spec, t

from llmgw import messages as m
from llmgw.fleet.gpuuse import summarize
from llmgw.fleet.state import fold


def beat(at_min: float, used: int) -> m.HeartbeatSent:
    return m.HeartbeatSent(at=t(at_min), node="n1", boot_id="b", seq=1, gpus=(
        m.GpuSample(index=0, utilization_pct=0, memory_used_mib=used, memory_total_mib=81920),
        m.GpuSample(index=1, utilization_pct=0, memory_used_mib=500, memory_total_mib=81920)))


def test_a_gpus_memory_sampled_before_its_replica_stopped_is_not_shown_as_used() -> None:
    s = spec("qwen-8b")
    ref = m.GpuRef(node="n1", index=0, uuid="GPU-n1-0", mib=81920)
    state = fold([inventory("n1", "ib-a", 2, t(0)), m.ModelDeclared(at=t(1), spec=s),
                  m.ReplicaPlaced(at=t(2), replica_id="qwen-8b-r1", model=s.name, nodes=("n1",), gpus=(ref,), spec=s),
                  m.ReplicaStopped(at=t(10), replica_id="qwen-8b-r1", model=s.name, reason="idle", code="idle")])
    (use,), (node,) = summarize(state, {"n1": beat(9, 70_000)}, nodes=True)
    # GPU 0's sample is from before the stop: unknown until the next heartbeat; GPU 1's stands.
    assert (use.sampled, use.memory_used_mib, use.memory_total_mib) == (2, 500, 81920)
    assert [g.memory_used_mib for g in node.gpus] == [None, 500]
    (after,), _ = summarize(state, {"n1": beat(11, 600)})
    assert (after.memory_used_mib, after.memory_total_mib) == (1100, 2 * 81920)
