"""The fleet core: the one fold of the history streams and the pure queries over it.

Every reader (the projector, a replay, the scheduler, the planner, the routers'
pool, the liveness monitor) folds by one function, ``fold.fold_batch``, and
differs only in which of the memories beside the fold it keeps (``history``,
``demand``, ``observed``, ``pool``); ``projections/`` only writes DuckDB.
"""

from llmgw.fleet.state import (
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
