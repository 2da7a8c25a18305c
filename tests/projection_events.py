"""Events of a small fleet, shared by the projection tests (real Structs, published for real)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import strategies as st

from llmgw import messages as m

T0 = datetime(2026, 3, 2, 10, 0, tzinfo=UTC)


def t(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def gpu(node: str, index: int, gpu_class: str = "H100-80GB", healthy: bool = True) -> m.GpuInfo:
    return m.GpuInfo(
        index=index,
        uuid=f"GPU-{node}-{index}",
        name="NVIDIA " + gpu_class,
        gpu_class=gpu_class,
        memory_mib=81559 if gpu_class.startswith("H100") else 46068,
        healthy=healthy,
        reasons=() if healthy else ("xid-79",),
    )


def inventory(node: str, fabric: str, count: int, at: datetime, gpu_class: str = "H100-80GB",
              unhealthy: tuple[int, ...] = ()) -> m.NodeInventoryReported:
    return m.NodeInventoryReported(
        at=at, node=node, fabric=fabric, fabric_source="fleet-file", boot_id=f"boot-{node}",
        gpus=tuple(gpu(node, i, gpu_class, i not in unhealthy) for i in range(count)), simulated=True,
    )


def spec(name: str, gpu_class: str = "H100-80GB", tp: int = 1, pp: int = 1, replicas: int = 1) -> m.ModelSpec:
    return m.ModelSpec(name=name, source=f"org/{name}", precision="bf16", engine="vllm",
                       gpu_class=gpu_class, context=8192, tp=tp, pp=pp, replicas=replicas)


def placed(rid: str, s: m.ModelSpec, gpus: list[tuple[str, int]], at: datetime, fabric: str = "ib-a") -> m.ReplicaPlaced:
    nodes = tuple(dict.fromkeys(n for n, _ in gpus))
    return m.ReplicaPlaced(at=at, replica_id=rid, model=s.name, nodes=nodes, fabric=fabric, spec=s,
                           gpus=tuple(m.GpuRef(node=n, index=i, uuid=f"GPU-{n}-{i}") for n, i in gpus))


def small_fleet() -> list[m.Event]:
    """Four nodes, one unhealthy GPU, a multi-node replica, an idle and an unknown replica, one unplaceable model."""
    llama, qwen, gemma, deepseek = spec("llama-70b", tp=4, pp=2), spec("qwen-8b"), spec("gemma-9b", "L40S-48GB"), spec("deepseek-v3", tp=8, pp=4)
    return [
        inventory("n1", "ib-a", 4, t(0)),
        inventory("n2", "ib-a", 4, t(0)),
        inventory("n3", "ib-a", 4, t(0)),
        inventory("n4", "pcie", 2, t(0), gpu_class="L40S-48GB"),
        inventory("n5", "ib-b", 4, t(0)),
        m.GpuHealthChanged(at=t(1), node="n1", gpu_index=2, gpu_uuid="GPU-n1-2", healthy=False, reasons=("xid-79",)),
        m.NodeLost(at=t(2), node="n5"),
        m.ModelDeclared(at=t(3), spec=llama),
        m.ModelDeclared(at=t(3), spec=qwen),
        m.ModelDeclared(at=t(3), spec=gemma),
        m.ModelDeclared(at=t(3), spec=deepseek),
        placed("r-llama", llama, [("n2", i) for i in range(4)] + [("n3", i) for i in range(4)], t(4)),
        placed("r-qwen", qwen, [("n1", 0)], t(4)),
        placed("r-gemma", gemma, [("n4", 0)], t(4), fabric="pcie"),
        m.ModelUnplaceable(at=t(5), name="deepseek-v3", reason="needs 4 whole H100-80GB nodes on one fabric; ib-a has 0 free, ib-b 0"),
        m.ReplicaStateChanged(at=t(6), replica_id="r-llama", model="llama-70b", node="n2", state="healthy", endpoint="http://n2:8000"),
        m.ReplicaStateChanged(at=t(6), replica_id="r-llama", model="llama-70b", node="n3", state="healthy"),  # its second part
        m.ReplicaStateChanged(at=t(6), replica_id="r-qwen", model="qwen-8b", node="n1", state="healthy", endpoint="http://n1:8000"),
        m.ReplicaStateChanged(at=t(6), replica_id="r-gemma", model="gemma-9b", node="n4", state="starting"),
        m.IdleMapPublished(at=t(10), router="rt-a", boot_id="a1", tick=1,
                           last_request={"r-qwen": t(7), "r-llama": t(9)}),
        m.IdleMapPublished(at=t(10), router="rt-b", boot_id="b1", tick=1, last_request={"r-qwen": t(8)}),
        m.IdleMapPublished(at=t(100), router="rt-a", boot_id="a1", tick=2, last_request={"r-qwen": t(7), "r-llama": t(95)}),
        m.IdleMapPublished(at=t(100), router="rt-b", boot_id="b2", tick=1),  # restarted: knows nothing
    ]


# --- random histories, for the property tests ------------------------------------------------------

BAD = b'{"type":"NodeInventoryReported","at":"not a time"}'  # an event no decoder takes

NODES = ("n0", "n1", "n2")
MODEL = spec("qwen-8b")


def random_event(kind: int, i: int, a: int, b: int) -> m.Event | bytes:
    node = NODES[a % 3]
    at = t(i)
    rid = f"r{b % 3}"
    match kind:
        case 0:
            return inventory(node, "ib-a" if a % 2 else "ib-b", 1 + b % 3, at)
        case 1:
            return m.GpuHealthChanged(at=at, node=node, gpu_index=b % 3, gpu_uuid=f"GPU-{node}-{b % 3}", healthy=bool(a % 2))
        case 2:
            return m.NodeLost(at=at, node=node) if b % 2 else m.NodeReturned(at=at, node=node)
        case 3:
            return m.ModelDeclared(at=at, spec=MODEL) if b % 2 else m.ModelUnplaceable(at=at, name=MODEL.name, reason=f"r{a}")
        case 4:
            return placed(rid, MODEL, [(node, b % 3)], at)
        case 5:
            return m.ReplicaStateChanged(at=at, replica_id=rid, model=MODEL.name, node=node,
                                         state=("starting", "healthy", "failed", "stopped")[a % 4])
        case 6:
            return m.ReplicaStopped(at=at, replica_id=rid, model=MODEL.name, reason="idle")
        case 7:
            return m.IdleMapPublished(at=at, router=f"rt{a % 2}", boot_id=f"b{b % 2}", tick=i,
                                      last_request={rid: t(i - a % 5)} if b % 3 else {},
                                      serving_since={f"r{a % 3}": t(i - 1)} if b % 2 else {})
        case _:
            return BAD + str(i).encode()


event_lists = st.lists(
    st.tuples(st.integers(0, 8), st.integers(0, 7), st.integers(0, 7)), min_size=2, max_size=24
).map(lambda xs: [random_event(k, i, a, b) for i, (k, a, b) in enumerate(xs)])
