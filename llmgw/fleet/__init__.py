"""The fleet core: the one fold of the history streams and the pure queries over it.

The planner, the scheduler, the router and the projector all fold the same
events with the same ``apply``; ``projections/`` only writes DuckDB.
"""

from llmgw.fleet.fold import (
    FleetState,
    GpuView,
    ModelView,
    NodeView,
    ReplicaView,
    RouterView,
    apply,
    fold,
    part_state,
    refusal,
    speaks_for,
)

__all__ = ["FleetState", "GpuView", "ModelView", "NodeView", "ReplicaView", "RouterView", "apply", "fold", "part_state", "refusal", "speaks_for"]
