"""The fleet core: the one fold of the history streams and the pure queries over it.

``state.apply(state, event)`` folds one event into a ``FleetState`` (nodes and GPUs,
models and replicas, the routers' idle maps); ``fold.fold_batch`` is the one rule every
reader folds a batch by (the projector, a replay, the scheduler, the planner, the
routers' pool, the liveness monitor, the agents): refuse, clamp, note history, observe,
apply. Readers differ only in which of the memories beside the fold they keep
(``fold.Memories``: ``history``, ``demand``, ``observed``, ``pool``, ``lost``).
``replay`` folds the streams up to any moment, from the newest fold snapshot
(``snapshots``) before it; ``status`` and ``gpuuse`` answer ``ctl status`` from the
state. ``projections/`` only writes DuckDB.
"""

from llmgw.fleet.fold import Checkpoint, Memories, fold_batch
from llmgw.fleet.history import ModelHistory, percentile
from llmgw.fleet.snapshots import DEFAULT_EVERY_EVENTS as SNAPSHOT_EVERY_EVENTS
from llmgw.fleet.snapshots import DEFAULT_INTERVAL_S as SNAPSHOT_INTERVAL_S
from llmgw.fleet.state import (
    MAX_AHEAD,
    FleetState,
    GpuView,
    ModelView,
    NodeView,
    ReplicaView,
    RouterView,
    apply,
    part_state,
    refusal,
    speaks_for,
)
from llmgw.fleet.status import IdleRow, idle_rows, nobody_asked

__all__ = [
    "MAX_AHEAD", "SNAPSHOT_EVERY_EVENTS", "SNAPSHOT_INTERVAL_S", "Checkpoint", "FleetState", "GpuView", "IdleRow", "Memories", "ModelHistory", "ModelView", "NodeView",
    "ReplicaView", "RouterView", "apply", "fold_batch", "idle_rows", "nobody_asked", "part_state", "percentile",
    "refusal", "speaks_for",
]
