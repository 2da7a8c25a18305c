"""What engines of a spec reserved on this fleet: the planner's observed KV, a pure fold of replica reports.

Kept in the fleet core beside the fold, so that every reader folds it by the one
rule (``llmgw.fleet.checkpoint``) and a fold snapshot carries it; the planner
plans from it (``llmgw.planner.plan``).
"""

from __future__ import annotations

from llmgw import messages as m
from llmgw.fleet.state import FleetState

MAX_OBSERVED_TOKENS = 10**10  # no card holds more; a larger figure is a broken or lying agent
MAX_OBSERVED_RATIO = 4  # nor does an engine reserve 4 x what the plan left for the cache


def observation_key(source: str, precision: str, tp: int, pp: int, gpu_class: str, util: float, kv_dtype: str,
                    engine_version: str = "") -> str:
    """The spec facts a vLLM engine's reservation depends on (not the context: vLLM sizes the cache by memory).

    With the engine version the spec was planned for: what one version reserved says nothing of
    another (each counts a different overhead). "" is a spec declared before plans named one.
    """
    key = f"{source}|{precision}|{tp}|{pp}|{gpu_class}|{util:g}|{kv_dtype}"
    return f"{key}|{engine_version}" if engine_version else key


def record_observation(observed: dict[str, int], state: FleetState, event: m.ReplicaStateChanged) -> bool | None:
    """Keep a healthy engine's KV reservation (tokens) by ``observation_key``: True kept, False refused
    (implausible, or not from the replica's own node), None when the event carries none.

    llama.cpp's figure is never kept: it allocates exactly the -c it was given, which says what
    was asked for, not what the card holds (``ctl model show`` still lists it per replica).
    """
    if event.state != "healthy" or event.observed_kv_tokens == 0:
        return None
    replica = state.replicas.get(event.replica_id)
    if replica is None or event.node not in replica.nodes:
        return False
    spec = replica.spec
    if spec.engine == "llama.cpp":
        return None
    tokens = event.observed_kv_tokens
    if not 0 < tokens <= MAX_OBSERVED_TOKENS or (spec.kv_tokens and tokens > MAX_OBSERVED_RATIO * spec.kv_tokens):
        return False
    key = observation_key(spec.source, spec.precision, spec.tp, spec.pp, spec.gpu_class, spec.gpu_memory_utilization,
                          spec.kv_cache_dtype, spec.engine_version)
    observed[key] = tokens
    return True
