"""The capacity planner: will a model fit, and how to split it. Pure: no I/O, no clock.

The bytes per GPU of one split come from ``llmgw.planner.memory`` (its docstring states the
memory model); this module judges splits against the fleet's cards: the context each
holds, how many replicas fit, the engine command, and the order candidates are shown in.

A candidate fits when weights + overhead leave room for the context asked for
(default: the model's full context, capped at 32,768, else the largest that fits,
at least 2048 tokens): vLLM refuses to start when one sequence of ``max_model_len``
does not fit in the KV cache.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from llmgw import messages as m
from llmgw.engine.argv import shown_command, shown_node_commands
from llmgw.engine.profiles import (
    EngineProfile,
    fleet_version,
    parse_version,
    planned_version,
    profile_for,
)
from llmgw.errors import PlanError
from llmgw.fleet.observed import observation_key
from llmgw.fleet.state import FleetState, booking_mib, by_fabric
from llmgw.messages.control import Dtype
from llmgw.planner.adapters import lora_bytes_per_gpu, vllm_rank
from llmgw.planner.memory import (
    BY_NAME,
    CUDA_CONTEXT_BYTES,
    DEFAULT_CONTEXT_CAP,
    DEFAULT_TPS,
    GGUF_NAMES,
    LLAMACPP_CTX_PAD,
    MAX_PP,
    MIB,
    MIN_CONTEXT,
    RANK,
    VLLM_BLOCK,
    KvShape,
    Precision,
    capture_headroom,
    cuda_graph_bytes_per_gpu,
    engine_kv_tokens,
    gib,
    layout,
    precision,
    profile_activation_bytes,
    sizes,
)

# --- one candidate ---------------------------------------------------------------------------------


def gguf_file(info: m.ModelInfo, p: Precision) -> str:
    """The conventional GGUF file name: ``Qwen2.5-14B-Instruct-Q4_K_M.gguf``."""
    return f"{info.name.rstrip('/').split('/')[-1]}-{p.name.upper()}.gguf"


def plan_name(model: str) -> str:
    """The name a plan serves a model under in its commands and declaration: its repository's last part, lower case."""
    return model.rstrip("/").split("/")[-1].lower()


def own_16bit(info: m.ModelInfo) -> str:
    """The checkpoint's own 16-bit precision: fp16 where it holds float16, else bf16."""
    return "fp16" if info.torch_dtype == "float16" else "bf16"


def dtype_for(info: m.ModelInfo, p: Precision) -> Dtype:
    """vLLM's ``--dtype``: named only for a 16-bit precision other than the checkpoint's own."""
    if p.kind != "16bit" or p.name == own_16bit(info):
        return "auto"
    return "float16" if p.name == "fp16" else "bfloat16"


def quantization_flag(info: m.ModelInfo, p: Precision) -> str | None:
    """``--quantization`` wherever vLLM would otherwise load the checkpoint's 16-bit weights."""
    if p.engine != "vllm" or p.kind == "16bit":
        return None
    if info.quantization == p.name:
        return None  # the checkpoint is already quantized so; vLLM reads that from its config
    return p.name


def kv_dtype_for(info: m.ModelInfo, p: Precision, asked: str) -> str:
    """The KV cache dtype a candidate runs: what was asked, else the checkpoint's own; llama.cpp keeps f16."""
    if p.engine != "vllm":
        return "auto"
    if asked != "auto":
        return asked
    return info.kv_cache_dtype or "auto"


@dataclass(frozen=True)
class Split:
    """Where and how one replica would run."""

    gpu_class: str
    fabric: str | None
    memory_mib: int
    tp: int
    pp: int = 1


DEFAULT_LORA_RANK = 16  # vLLM's own --max-lora-rank default, when adapters are asked for and no rank


def default_context(info: m.ModelInfo) -> int:
    """The context candidates are judged at when none is asked for."""
    return min(info.max_position_embeddings, DEFAULT_CONTEXT_CAP)


EAGER_COST = ("--enforce-eager captures no CUDA graphs: each decode step launches its kernels one by one, "
              "typically 1.5-3x slower at small batches; prefill is unchanged")


def _graph_plan(info: m.ModelInfo, kv: KvShape, mem: float, util: float, weights: float, overhead: float,
                graphs: float, want: int, profile: EngineProfile, freed: float = 0.0) -> tuple[str, float, float, str | None]:
    """Where the CUDA graphs of a vLLM candidate go: (mode, utilization, bytes left for KV, note).

    From 0.20 vLLM takes them from the budget itself. Before, it captures them after sizing the
    cache, out of what the budget leaves (``capture_headroom``: the slack beside the CUDA context,
    and ``freed``, the profiling run's activation, where the version captures into it); where that
    cannot hold them the engine would die at start-up, so the plan lowers the utilization until it
    does (when the cache still holds ``want`` tokens), or runs eagerly without graphs.
    """
    budget = util * mem
    if profile.graphs_in_budget:
        return "budget", util, budget - weights - overhead - graphs, None
    room = capture_headroom(mem, util, freed)
    if graphs <= room:
        return "slack", util, budget - weights - overhead, None
    beside = f" and the {gib(freed)} GiB its profiling run freed" if freed else ""
    short = (f"the {gib(max(0.0, room))} GiB free when {profile.name} captures its CUDA graphs after sizing the cache "
             f"(the slack beside the CUDA context, 1 - {util:g} of the card{beside}) cannot hold them "
             f"(~{gib(graphs)} GiB per GPU): the engine would size its cache and die capturing them")
    charged_util = int((mem - graphs - CUDA_CONTEXT_BYTES + freed) / mem * 100) / 100
    charged = charged_util * mem - weights - overhead
    if charged_util > 0 and kv.bytes_for(want) <= charged:
        return "charged", charged_util, charged, (
            f"{short}; planned at --gpu-memory-utilization {charged_util:g}, which leaves them room and costs "
            f"{gib(budget - charged_util * mem)} GiB of KV cache per GPU; or keep {util:g} with {EAGER_COST}")
    return "eager", util, budget - weights - overhead, (
        f"{short}, and a utilization that leaves them room leaves too little KV cache for {want:,} tokens: "
        f"the command runs {EAGER_COST}")


def evaluate(info: m.ModelInfo, p: Precision, split: Split, *, context: int | None, util: float | None,
             replicas_now: int, kv_dtype: str = "auto", observed: int | None = None, parallel: int = 0,
             version: str = "", max_num_seqs: int = 0, lora: tuple[int, int, int] = (0, 0, 0)) -> m.Candidate:
    """Fit one precision on one split: weights, overhead and KV per GPU, and the context left.

    With no ``context``, a split that holds ``default_context`` runs at it; one that
    holds less (but at least MIN_CONTEXT) still fits, at the most it holds. llama.cpp
    gives each of its ``parallel`` slots the whole context: its cache holds that many.
    vLLM is planned as the profile of ``version`` counts its overhead (``util`` None: that
    version's default), with ``max_num_seqs`` (0: the version's default on this card, or
    ``parallel`` when that was given). ``lora``: (vLLM's --max-loras, --max-lora-rank, llama.cpp's
    attached adapters' bytes): their buffers are charged as overhead, beside the weights.
    """
    slots = max(1, parallel) if p.engine == "llama.cpp" else 1
    tp, pp = split.tp, split.pp
    profile = profile_for(p.engine, version)
    asked_util = profile.default_util if util is None else util
    mem = split.memory_mib * MIB
    kv_dtype = kv_dtype_for(info, p, kv_dtype)
    tokens, seqs = profile.batch(split.gpu_class, split.memory_mib)
    if p.engine == "vllm" and (max_num_seqs or parallel):
        seqs = max_num_seqs or parallel
        tokens = max(tokens, seqs)  # vLLM refuses max_num_batched_tokens below max_num_seqs
    weights, overhead, kv = sizes(info, p, tp, pp, kv_dtype, split.gpu_class, profile=profile, batch=(tokens, seqs))
    max_loras, max_rank, adapter_bytes = lora if p.engine == "vllm" else (0, 0, lora[2])
    lora_bytes = lora_bytes_per_gpu(info, p.engine, tp, pp, max_loras=max_loras, max_rank=max_rank,
                                    adapter_bytes=adapter_bytes)
    overhead += lora_bytes
    graphs = cuda_graph_bytes_per_gpu(info, tp, pp, seqs) if p.engine == "vllm" else 0.0
    want = (context or default_context(info)) * slots
    if p.engine == "vllm":
        freed = profile_activation_bytes(overhead - lora_bytes, profile, tp, pp) \
            if profile.capture_reuses_profile(version) else 0.0
        mode, util, kv_budget, graph_note = _graph_plan(info, kv, mem, asked_util, weights, overhead, graphs, want,
                                                        profile, freed)
    else:
        mode, util, kv_budget, graph_note = "", asked_util, asked_util * mem - weights - overhead, None
    eager = mode == "eager"
    if eager:
        graphs = 0.0
    budget = util * mem
    block = LLAMACPP_CTX_PAD if p.engine == "llama.cpp" else VLLM_BLOCK
    if p.engine == "vllm":  # the tokens its log would print (a hybrid's count in its layer groups' pages)
        kv_tokens = engine_kv_tokens(kv, kv_budget, want, profile) // VLLM_BLOCK * VLLM_BLOCK
    else:
        kv_tokens = max(0, int(kv_budget // kv.bytes_per_token) // VLLM_BLOCK * VLLM_BLOCK) if kv.bytes_per_token else 0
    estimated = kv_tokens
    if observed is not None and not kv.uniform:
        observed = None  # vLLM's metrics count another unit (one layer group's blocks): the estimate stands
    if observed is not None and kv.bytes_per_token:
        # An engine of this very spec ran here: what it reserved replaces the estimate.
        kv_tokens = observed
        kv_budget = float(observed * kv.bytes_per_token)
    # Each llama.cpp slot keeps its own window of a sliding layer and its own recurrent state: a slot's
    # share of the cache is what one sequence may hold.
    longest = kv.max_context(kv_budget / slots)
    max_context = info.max_position_embeddings if longest >= info.max_position_embeddings else longest // block * block
    reason: str | None = None
    if kv_budget <= 0:
        graph_part = f" + CUDA graphs {gib(graphs)} GiB" if mode == "budget" else ""
        reason = (f"weights {gib(weights)} GiB + overhead {gib(overhead)} GiB{graph_part} per GPU exceed the "
                  f"{gib(budget)} GiB budget ({util:g} x {gib(mem)} GiB)")
        chosen = context or info.max_position_embeddings
    elif context is not None:
        chosen = context
        if kv.bytes_for(context) * slots > kv_budget:
            each = f" in each of {slots} slots" if slots > 1 else ""
            reason = (f"a {context}-token context{each} needs {gib(kv.bytes_for(context) * slots)} GiB of KV cache "
                      f"per GPU; {gib(kv_budget)} GiB is left, enough for {max_context} tokens{each}")
    else:
        chosen = min(max_context, default_context(info))
        floor = min(MIN_CONTEXT, info.max_position_embeddings)
        if max_context < floor:
            reason = f"the {gib(kv_budget)} GiB left for KV cache per GPU holds {max_context} tokens, under {floor}"
    fits = reason is None
    if fits:
        max_context = max(max_context, chosen)  # a context that fits is never above the reported maximum
    file = gguf_file(info, p) if p.kind == "gguf" else None
    vllm_seqs = seqs if p.engine == "vllm" else 0
    if p.engine == "llama.cpp" and fits:
        # llama.cpp allocates its -c (slots x context) and no more, whatever the card would hold: what
        # it books on a GPU it shares (vLLM fills its budget, so its KV is the budget's rest).
        kv_budget = float(kv.bytes_for(chosen) * slots)
    c = m.Candidate(
        gpu_class=split.gpu_class,
        fabric=split.fabric,
        nodes=pp,
        tp=tp,
        pp=pp,
        precision=p.name,
        engine=p.engine,
        quantization=quantization_flag(info, p),
        fits=fits,
        reason=reason,
        weights_gib_per_gpu=gib(weights),
        kv_bytes_per_token_per_gpu=kv.bytes_per_token,
        kv_gib_per_gpu=gib(max(0.0, kv_budget)),
        kv_tokens=kv_tokens,
        max_context=max_context,
        replicas_now=replicas_now if fits else 0,
        command="",
        parallel=parallel,
        kv_cache_dtype=kv_dtype,
        observed_kv_tokens=observed,
        estimated_kv_tokens=estimated,
        source=info.source,
        context=chosen,
        gpus=tp * pp,
        gpu_memory_gib=gib(mem),
        gpu_memory_utilization=util,
        overhead_gib_per_gpu=gib(overhead),
        lora_gib_per_gpu=gib(lora_bytes),
        max_adapters=max_loras,
        max_lora_rank=vllm_rank(max_rank) if max_loras else 0,
        file=file,
        file_gib=gib(layout(info, p).total) if file else None,
        engine_version=planned_version("vllm", version) if p.engine == "vllm" else "",
        engine_profile=profile.name if p.engine == "vllm" else "",
        max_num_seqs=vllm_seqs,
        cuda_graph_gib_per_gpu=gib(graphs),
        cuda_graphs=mode,
        graph_note=graph_note,
        enforce_eager=eager,
        dtype=dtype_for(info, p),
    )
    # What it prints is what an agent runs for its declaration: one builder, from the spec alone.
    spec = c.spec(plan_name(info.name))
    return msgspec.structs.replace(c, command=shown_command(spec), node_commands=shown_node_commands(spec),
                                   booked_gib_per_gpu=gib(booking_mib(spec, split.memory_mib) * MIB))


# --- the fleet as pools -----------------------------------------------------------------------------


@dataclass
class NodeSlots:
    name: str
    fabric: str
    healthy: int  # healthy GPUs of the class on this live node
    free: int  # of which no replica holds


@dataclass
class ClassPool:
    gpu_class: str
    memory_mib: int
    nodes: list[NodeSlots] = field(default_factory=list)

    def fabrics(self) -> dict[str, list[NodeSlots]]:
        return by_fabric(self.nodes, lambda n: n.fabric)


def pools(fleet: FleetState) -> dict[str, ClassPool]:
    """Live healthy GPUs by class; unhealthy GPUs are neither used nor free."""
    held = fleet.held_gpus()
    out: dict[str, ClassPool] = {}
    for node in fleet.nodes.values():
        if node.lost:
            continue
        free: dict[str, int] = {}
        for g in fleet.free_gpus(node, held):
            free[g.gpu_class] = free.get(g.gpu_class, 0) + 1
        by_class: dict[str, list[int]] = {}
        for g in node.gpus.values():
            if g.healthy:
                by_class.setdefault(g.gpu_class, []).append(g.memory_mib)
        for cls, mems in by_class.items():
            pool = out.setdefault(cls, ClassPool(cls, min(mems)))
            pool.memory_mib = min(pool.memory_mib, *mems)
            pool.nodes.append(NodeSlots(node.name, node.fabric, len(mems), free.get(cls, 0)))
    return out


def replicas_single(nodes: Iterable[NodeSlots], tp: int) -> int:
    return sum(n.free // tp for n in nodes)


def replicas_multi(nodes: Iterable[NodeSlots], tp: int, pp: int) -> int:
    """Replicas of pp stages on pp distinct nodes, each stage tp GPUs of one node."""
    slots = [n.free // tp for n in nodes if n.free >= tp]
    r = sum(slots) // pp
    while r > 0 and sum(min(s, r) for s in slots) < r * pp:
        r -= 1
    return r


# --- the plan ---------------------------------------------------------------------------------------


def valid_tp(info: m.ModelInfo, tp: int) -> bool:
    """vLLM splits attention heads evenly, and KV heads evenly or by replication."""
    if tp < 1 or info.num_attention_heads % tp:
        return False
    if info.kv_lora_rank:
        return True
    kv = info.num_kv_heads
    return kv % tp == 0 or tp % kv == 0


def available_precisions(info: m.ModelInfo) -> tuple[Precision, ...]:
    """What the repository can be served at: its own format (and fp8 when 16-bit), and the GGUF mixes."""
    q = info.quantization
    if q:
        own: tuple[str, ...] = (q,)
    else:
        own = (own_16bit(info), "fp8")
    return tuple(BY_NAME[n.lower()] for n in (*own, *GGUF_NAMES))


def _check_precision(info: m.ModelInfo, p: Precision) -> None:
    q = info.quantization
    if p.kind == "16bit" and q:
        raise PlanError(f"{info.name} holds {q} weights; vLLM serves them as {q}, not {p.name}: "
                        f"choose --precision {q} or a GGUF precision ({', '.join(GGUF_NAMES)})")
    if p.kind in ("int4", "ckpt") and q != p.name:
        raise PlanError(f"{p.name} needs a repository that holds {p.name.upper()} weights (e.g. an "
                        f"…-{p.name.upper()} repository); {info.name} holds {q or info.torch_dtype}: "
                        f"choose --precision fp8, a GGUF precision, or plan that repository")
    if p.kind == "fp8" and q not in (None, "fp8"):
        raise PlanError(f"{info.name} holds {q} weights; fp8 needs the 16-bit or fp8 repository")


# What a real decoder-only model stays within; a request carrying other facts is refused, not computed.
_LIMITS = {"num_layers": 2048, "hidden_size": 1 << 18, "intermediate_size": 1 << 20, "num_attention_heads": 4096,
           "num_kv_heads": 4096, "head_dim": 4096, "vocab_size": 1 << 24, "max_position_embeddings": 1 << 27,
           "num_experts": 4096, "moe_intermediate_size": 1 << 20}


def _check_model(info: m.ModelInfo) -> None:
    for name, limit in _LIMITS.items():
        value = getattr(info, name)
        low = 0 if name in ("num_experts", "moe_intermediate_size", "intermediate_size") else 1
        if not low <= value <= limit:
            raise PlanError(f"{info.name}: {name} = {value} is outside {low}..{limit}; "
                            "check the model's config.json (or the ModelInfo sent)")
    if not info.kv_lora_rank and info.num_attention_heads % info.num_kv_heads:
        raise PlanError(f"{info.name}: {info.num_kv_heads} KV heads do not group its {info.num_attention_heads} "
                        "attention heads (each KV head serves a whole number of them); check the model's config.json "
                        "(or the ModelInfo sent)")
    if not 0 <= info.params <= 1 << 45:
        raise PlanError(f"{info.name}: {info.params} parameters is not a model size; pass --params")


def validate(info: m.ModelInfo, request: m.PlanRequest) -> tuple[tuple[Precision, ...], tuple[int, ...]]:
    """The precisions and tps to try, or a PlanError that says why the request makes no sense."""
    if request.params is not None and request.params <= 0:
        raise PlanError(f"--params must be a positive parameter count (got {request.params})")
    _check_model(info)
    util = request.gpu_memory_utilization
    if util is not None and not 0 < util <= 1:
        raise PlanError(f"--gpu-memory-utilization is the fraction of each card the engine may use; "
                        f"it must be above 0 and at most 1 (got {util:g})")
    if request.engine_version:
        parse_version(request.engine_version)  # a PlanError that says what to write
    if request.context is not None and not 1 <= request.context <= info.max_position_embeddings:
        raise PlanError(f"--context {request.context} is outside what {info.name} supports "
                        f"(1 to {info.max_position_embeddings} tokens, its max_position_embeddings)")
    if request.precisions:
        precs = tuple(dict.fromkeys(precision(n) for n in request.precisions))
        for p in precs:
            _check_precision(info, p)
    else:
        precs = available_precisions(info)
    tps = tuple(dict.fromkeys(request.tp)) or DEFAULT_TPS
    for tp in request.tp:
        if not 1 <= tp <= 64:
            raise PlanError(f"--tp {tp} is not a GPU count between 1 and 64")
        if any(p.engine == "vllm" for p in precs) and not valid_tp(info, tp):
            good = ", ".join(str(t) for t in DEFAULT_TPS if valid_tp(info, t))
            kv = "" if info.kv_lora_rank else f" and {info.num_kv_heads} KV heads"
            raise PlanError(f"--tp {tp} does not split the {info.num_attention_heads} attention heads{kv} "
                            f"of {info.name} evenly; use one of {good}")
    return precs, tps


def _sort_key(c: m.Candidate, target: int) -> tuple[object, ...]:
    """Fitting first; those that hold the common context before those that hold less; then
    the fewest GPUs, the highest precision, the longest context."""
    return (not c.fits, c.context < target, c.gpus, RANK[c.precision], -c.max_context, c.gpu_class, c.fabric or "")


def best_per_class(candidates: Iterable[m.Candidate]) -> list[m.Candidate]:
    """The first candidate of each (GPU class, precision), in the order given."""
    seen: set[tuple[str, str]] = set()
    out = []
    for c in candidates:
        if (c.gpu_class, c.precision) not in seen:
            seen.add((c.gpu_class, c.precision))
            out.append(c)
    return out


def plan(model: m.ModelInfo, fleet: FleetState, request: m.PlanRequest, *,
         fleet_pools: dict[str, ClassPool] | None = None, observed: dict[str, int] | None = None,
         engine_versions: dict[str, str] | None = None) -> m.PlanReply:
    """Every way to run one replica of a model on the fleet; with ``all``, those that do not fit too.

    ``fleet_pools`` is ``pools(fleet)`` when the caller keeps it between requests; ``observed``
    what engines of a spec reserved on this fleet (``record_observation``), used in place of
    the estimate for candidates of that very spec and engine version; ``engine_versions`` the
    vLLM version each node's agent reports (None: as the fold keeps them, each node's last
    inventory), planned for when the request names none.
    """
    observed = observed or {}
    if engine_versions is None:
        engine_versions = {name: n.vllm_version for name, n in fleet.nodes.items()}
    reported = [v for node, v in engine_versions.items() if v and node in fleet.nodes and not fleet.nodes[node].lost]
    if request.engine_version:
        version, version_source = request.engine_version.strip().removeprefix("v"), "--engine-version"
    elif (fleet_v := fleet_version(reported)):
        version, version_source = fleet_v, "fleet"
    else:
        version, version_source = "", "newest profile"
    profile = profile_for("vllm", version)

    def seen(p: Precision, tp: int, pp: int, cls: str) -> int | None:
        if not observed or p.engine == "llama.cpp" or request.max_adapters:  # LoRA buffers: another reservation
            return None  # what an older fold kept of llama.cpp's -c is no capacity either
        kv = kv_dtype_for(info, p, request.kv_cache_dtype)
        facts = (info.source, p.name, tp, pp, cls, util or profile.default_util, kv)
        # The --dtype the candidate's command names; a plan names no other cache-sizing argument.
        dtype = dtype_for(info, p)
        found = observed.get(observation_key(*facts, planned_version("vllm", version), dtype=dtype))
        if found is None and not request.engine_version:
            # Recorded before plans named their version: the fleet's own engines.
            found = observed.get(observation_key(*facts, dtype=dtype))
        return found

    info = model
    if request.params:
        info = _with_params(model, request.params)
    precs, tps = validate(info, request)
    lora = (request.max_adapters, request.max_lora_rank or (DEFAULT_LORA_RANK if request.max_adapters else 0),
            request.adapter_bytes)
    explicit_tp = bool(request.tp)
    util = request.gpu_memory_utilization
    out: list[m.Candidate] = []
    notes: list[str] = []
    if len(set(reported)) > 1:
        notes.append(f"the fleet's agents run vLLM {', '.join(sorted(set(reported)))}; planned for {version} "
                     "(the most common); --engine-version plans for another")
    by_class = pools(fleet) if fleet_pools is None else fleet_pools
    gpus = sum(n.healthy for p in by_class.values() for n in p.nodes)
    target = request.context or default_context(info)
    if not by_class:
        notes.append("the fleet has no live healthy GPUs: no agent has reported, or every node is lost; "
                     "start agents (`llmgw agent`) or plan against a fleet file with --fleet")
    for cls in sorted(by_class):
        pool = by_class[cls]
        widest = max(n.healthy for n in pool.nodes)
        free_slots: dict[int, int] = {}
        for p in precs:
            ok_tps = [t for t in tps if t <= widest and (p.engine == "llama.cpp" or valid_tp(info, t))]
            single_fits = False
            for tp in ok_tps:
                c = evaluate(info, p, Split(cls, None, pool.memory_mib, tp), context=request.context, util=util,
                             replicas_now=free_slots.setdefault(tp, replicas_single(pool.nodes, tp)),
                             kv_dtype=request.kv_cache_dtype, observed=seen(p, tp, 1, cls),
                             parallel=request.parallel, version=version, max_num_seqs=request.max_num_seqs,
                             lora=lora)
                single_fits |= c.fits and c.context >= target
                out.append(c)
            if p.engine != "vllm" or single_fits:
                continue  # multi-node only where one node cannot hold it; llama.cpp stays on one node
            for fabric, nodes in sorted(pool.fabrics().items()):
                for tp in ok_tps:
                    if not explicit_tp and tp != max(ok_tps):
                        continue  # across nodes, fill each node: smaller tp only adds stages
                    wide = [n for n in nodes if n.healthy >= tp]
                    for pp in range(2, min(len(wide), MAX_PP, info.num_layers) + 1):
                        c = evaluate(info, p, Split(cls, fabric, pool.memory_mib, tp, pp), context=request.context,
                                     util=util, replicas_now=0, kv_dtype=request.kv_cache_dtype,
                                     observed=seen(p, tp, pp, cls), parallel=request.parallel, version=version,
                                     max_num_seqs=request.max_num_seqs, lora=lora)
                        if c.fits:
                            out.append(msgspec.structs.replace(c, replicas_now=replicas_multi(wide, tp, pp)))
                            if c.context >= target:
                                break  # more stages than the fewest that hold it only cost GPUs
                        else:
                            out.append(c)
    fitting = [c for c in out if c.fits]
    if by_class and not fitting:
        notes.append(_nothing_fits(info, out, by_class))
    ranked = sorted(out if request.all else fitting, key=lambda c: _sort_key(c, target))
    if not request.all:
        ranked = best_per_class(ranked)
    return m.PlanReply(
        model=info.name,
        params=info.params,
        params_source=info.params_source,
        candidates=tuple(ranked),
        context=request.context,
        fleet_gpus=gpus,
        notes=tuple(notes),
        engine_version=planned_version("vllm", version),
        engine_profile=profile.name,
        engine_version_source=version_source,
    )


def _with_params(info: m.ModelInfo, params: int) -> m.ModelInfo:
    return msgspec.structs.replace(info, params=params, params_source="--params")


def _nothing_fits(info: m.ModelInfo, out: list[m.Candidate], by_class: dict[str, ClassPool]) -> str:
    biggest = max(by_class.values(), key=lambda p: (p.memory_mib, max(n.healthy for n in p.nodes)))
    if not out:
        return f"no split of {info.name} can land on this fleet (largest node: {max(n.healthy for n in biggest.nodes)} x {biggest.gpu_class})"
    best = min(out, key=lambda c: (c.weights_gib_per_gpu + c.overhead_gib_per_gpu, -c.gpus))
    return (f"nothing fits: the lightest split ({best.precision}, tp={best.tp}, pp={best.pp} on {best.gpu_class}) "
            f"needs {best.weights_gib_per_gpu + best.overhead_gib_per_gpu:.1f} GiB per GPU before KV cache; "
            f"{best.reason}; try a smaller --precision, a larger --tp, a shorter --context, or --all to see every split")
