"""What engines of a spec reserved on this fleet: the planner's observed KV, a pure fold of replica reports.

Kept in the fleet core beside the fold, so that every reader folds it by the one
rule (``llmgw.fleet.fold``) and a fold snapshot carries it; the planner plans from
it (``llmgw.planner.plan``). An observation is only as good as its key: a figure
is kept under every argument that sized the cache (the spec's, and the engine
arguments that override them), and never from an engine whose cache its card
did not size (a simulated node: vLLM on CPU takes VLLM_CPU_KVCACHE_SPACE; an
explicit cache size), which says what was asked for, not what a card holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw import messages as m
from llmgw.fleet.state import FleetState, NodeView

MAX_OBSERVED_TOKENS = 10**10  # no card holds more; a larger figure is a broken or lying agent
MAX_OBSERVED_RATIO = 4  # nor does an engine reserve 4 x what the plan left for the cache

# vLLM's --dtype spellings, as one; a 16-bit precision runs its own type under "auto" too.
_DTYPES = {"half": "float16", "float": "float32"}
_OWN_DTYPE = {"bf16": "bfloat16", "fp16": "float16"}
# Engine arguments that size vLLM's cache, and those that set its size outright.
_SIZING = ("--dtype", "--kv-cache-dtype", "--block-size", "--gpu-memory-utilization", "--cpu-offload-gb")
_EXPLICIT = ("--kv-cache-memory-bytes", "--num-gpu-blocks-override")


def observation_key(source: str, precision: str, tp: int, pp: int, gpu_class: str, util: float, kv_dtype: str,
                    engine_version: str = "", *, dtype: str = "auto", block_size: int = 0,
                    cpu_offload_gb: float = 0.0) -> str:
    """The facts a vLLM engine's reservation depends on (not the context: vLLM sizes the cache by memory).

    With the engine version the spec was planned for: what one version reserved says nothing of
    another (each counts a different overhead). "" is a spec declared before plans named one. The
    model's dtype (a float32 run holds twice a bf16 one's bytes a token), the block size and
    weights offloaded to the host are named only where they are not the default, so a plan made
    with none of them meets the key of a spec that ran with none.
    """
    key = f"{source}|{precision}|{tp}|{pp}|{gpu_class}|{util:g}|{kv_dtype}"
    if engine_version:
        key += f"|{engine_version}"
    dtype = _DTYPES.get(dtype, dtype)
    if dtype not in ("auto", _OWN_DTYPE.get(precision)):
        key += f"|dtype={dtype}"
    if block_size:
        key += f"|block={block_size}"
    if cpu_offload_gb:
        key += f"|offload={cpu_offload_gb:g}"
    return key


@dataclass(frozen=True)
class CacheArgs:
    """What sizes a spec's vLLM cache once its engine arguments (the last word, as vLLM reads them) are read."""

    dtype: str
    kv_dtype: str
    util: float
    block_size: int = 0
    cpu_offload_gb: float = 0.0
    explicit: str = ""  # the argument that sets the cache's size outright ("": the card's memory does)


def cache_args(spec: m.ModelSpec) -> CacheArgs:
    """The spec's cache-sizing arguments, overridden by any of its ``engine_args``."""
    given: dict[str, str] = {}
    args = list(spec.engine_args)
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        name = "--" + name.lstrip("-").replace("_", "-") if name.startswith("--") else name
        if name not in _SIZING and name not in _EXPLICIT:
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else ""
        given[name] = value
    explicit = next((name for name in _EXPLICIT if name in given), "")
    return CacheArgs(dtype=given.get("--dtype") or spec.dtype, kv_dtype=given.get("--kv-cache-dtype") or spec.kv_cache_dtype,
                     util=_number(given.get("--gpu-memory-utilization"), spec.gpu_memory_utilization),
                     block_size=int(_number(given.get("--block-size"), 0)),
                     cpu_offload_gb=_number(given.get("--cpu-offload-gb"), 0.0), explicit=explicit)


def _number(text: str | None, default: float) -> float:
    try:
        return float(text) if text else default
    except ValueError:
        return default  # vLLM refuses it and never starts: nothing is reported under it


def spec_key(spec: m.ModelSpec) -> str:
    """The ``observation_key`` of what a spec's engine reserves."""
    a = cache_args(spec)
    return observation_key(spec.source, spec.precision, spec.tp, spec.pp, spec.gpu_class, a.util, a.kv_dtype,
                           spec.engine_version, dtype=a.dtype, block_size=a.block_size, cpu_offload_gb=a.cpu_offload_gb)


def not_sized_by_card(spec: m.ModelSpec, node: NodeView | None) -> str | None:
    """Why what a vLLM engine of ``spec`` on ``node`` reserves says nothing of what its card holds, or None.

    ``node`` None: not known here (judged by the spec alone).
    """
    if node is not None and node.simulated:
        return f"{node.name} is simulated: its engine's cache is not sized by a card"
    explicit = cache_args(spec).explicit
    if explicit:
        return f"its engine runs with {explicit}: the cache is the size asked for"
    return None


def compared(spec: m.ModelSpec, node: NodeView | None) -> bool:
    """Whether an engine's KV report stands against the plan: llama.cpp's always (it allocates its -c,
    which is the plan's), vLLM's only where its card sized the cache."""
    return spec.engine == "llama.cpp" or not_sized_by_card(spec, node) is None


def record_observation(observed: dict[str, int], state: FleetState, event: m.ReplicaStateChanged) -> bool | None:
    """Keep a healthy engine's KV reservation (tokens) by ``spec_key``: True kept, False refused
    (implausible, or not from the replica's own node), None when the event carries none that is a
    card's capacity.

    llama.cpp's figure is never kept: it allocates exactly the -c it was given, which says what
    was asked for, not what the card holds (``ctl model show`` still lists it per replica). Nor is
    vLLM's where its card did not size it (``not_sized_by_card``), or from a node not known here.
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
    node = state.nodes.get(event.node)
    if node is None or not_sized_by_card(spec, node) is not None:
        return None
    observed[spec_key(spec)] = tokens
    return True
