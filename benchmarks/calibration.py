"""The planner's memory model against vLLM's own start-up logs: predicted vs observed weights and KV cache.

    python benchmarks/calibration.py            # the markdown table docs/planning.md quotes
    python benchmarks/calibration.py ROWS.jsonl # the same for other rows (a candidate's, before it joins)
    python benchmarks/calibration.py --fit      # what the fit gives each profile's fitted terms

The fitted terms of each vLLM profile (``FITTED``: the sampler's copies, and memory outside torch)
are fitted here: memory outside torch is what the profile's own logs print (``non_torch``), the copies
a least-squares grid fit (``fit``) on the profile's KV rows, each error in units of its tolerance; ``llmgw/engine/profiles.py``
holds what the fit gives on the whole set (``tests/test_calibration.py`` checks that it still does).
Beside the in-sample figures the table prints leave-one-source-out ones: every row planned with
factors fitted without any row of its own source (a repository, or a site), so that a factor only
its own row supports shows up.

Rows are ``tests/data/vllm_observed.jsonl``: figures vLLM printed at start-up
(``Model loading took X GiB``, ``Available KV cache memory: Y GiB``, ``GPU KV cache
size: N tokens``, ``# GPU blocks``), each with its public source. A row is in the
calibration set when it ran vLLM's V1 engine with a known card size and
``gpu_memory_utilization``, and its model's config.json is here (``config``:
a folder under ``examples/models`` or ``tests/data/calibration``, optionally with a
``quantization_config`` laid over it); the others are listed with why not.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "tests" / "data" / "vllm_observed.jsonl"
CONFIG_DIRS = (ROOT / "examples" / "models", ROOT / "tests" / "data" / "calibration")
GIB = 1024**3
KV_FLOOR_GIB = 0.75  # a KV figure is right within max(10 %, this)


@dataclass
class Result:
    row: dict[str, Any]
    weights: float | None = None  # predicted, GiB per GPU
    kv: float | None = None  # predicted, GiB per GPU (may be negative: does not start)
    observed_kv: float | None = None
    fits: bool | None = None
    observed_fits: bool | None = None
    excluded: str = ""
    counted_tokens: int | None = None  # the tokens the planner counts in the KV figure the log prints
    capture_ok: bool = True  # its CUDA graphs fit where the version captures them

    @property
    def kv_ok(self) -> bool | None:
        if self.kv is None or self.observed_kv is None:
            return None
        return abs(self.kv - self.observed_kv) <= max(0.1 * abs(self.observed_kv), KV_FLOOR_GIB)

    @property
    def weights_ok(self) -> bool | None:
        obs = self.row.get("weights_gib")
        if obs is None or self.weights is None:
            return None
        return abs(self.weights - obs) <= 0.05 * obs

    @property
    def profile(self) -> str:
        from llmgw.engine.profiles import profile_for

        return profile_for("vllm", str(self.row.get("vllm_version") or "")).name if self.row.get("vllm_version") else "-"


def rows(path: Path = ROWS) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _info(row: dict[str, Any]) -> Any:
    from llmgw.planner import modelinfo

    folder = next((d / row["config"] for d in CONFIG_DIRS if (d / row["config"] / "config.json").is_file()), None)
    if folder is None:
        raise FileNotFoundError(row["config"])
    info = modelinfo.load_dir(folder, name=row["model"], source=row["model"])
    if qc := row.get("quantization_config"):
        q = modelinfo.quantization(qc, row["model"])
        info = msgspec.structs.replace(info, quantization=q.precision, quant_bits=q.bits, quant_ignore=q.ignore,
                                       quant_format=q.format, kv_cache_dtype=q.kv_cache_dtype)
    return info


def _batch(row: dict[str, Any], profile: Any) -> tuple[int, int]:
    """The row's (max_num_batched_tokens, max_num_seqs): as it states them, else the version's defaults on its card."""
    gpu = str(row.get("gpu_class") or row.get("gpu") or "")
    tokens, seqs = profile.batch(gpu, int(float(row["gpu_memory_gib"]) * 1024))
    if row.get("max_num_seqs"):
        seqs = int(row["max_num_seqs"])
        tokens = max(tokens, seqs)
    if row.get("max_num_batched_tokens"):
        tokens = int(row["max_num_batched_tokens"])
    return tokens, seqs


def cold(row: dict[str, Any]) -> bool:
    """Whether the row's start compiled its graphs (``compile: cold``, or unstated: the planner's own assumption, a
    replica's first start) rather than loading them (``compile: warm``, its log: "Directly load the compiled graph");
    an eager start compiles nothing."""
    return row.get("compile", "cold") == "cold" and not row.get("enforce_eager")


def _as_installed(row: dict[str, Any], profile: Any) -> Any:
    """The profile as the row's install ran it: ``mxfp4_backend: marlin`` where its vLLM lacked ``triton_kernels``
    (a pip install of 0.11.0: the wheel did not depend on it until vllm PR 27370), so Hopper fell back to Marlin."""
    if row.get("mxfp4_backend") == "marlin" and profile.mxfp4_hopper_triton:
        return dataclasses.replace(profile, mxfp4_hopper_triton=False)
    return profile


def evaluate(row: dict[str, Any], profile: Any = None) -> Result:
    """One row: what the planner predicts for its model, card, split and settings, next to what vLLM printed
    (``profile``: plan with these factors instead of the version's profile)."""
    from llmgw.planner import memory as M

    r = Result(row)
    if why := row.get("excluded"):
        r.excluded = why
        return r
    info = _info(row)
    p = M.precision(info.quantization or ("fp16" if info.torch_dtype == "float16" else "bf16"))
    tp, pp = int(row.get("tp") or 1), int(row.get("pp") or 1)
    kv_dtype = row.get("kv_cache_dtype") or "auto"
    gpu = str(row.get("gpu_class") or row.get("gpu") or "")
    from llmgw.engine.profiles import profile_for

    if row.get("weights_only"):  # the log gives the weights alone (no card size or KV figure)
        installed = _as_installed(row, profile_for("vllm", str(row.get("vllm_version") or "")))
        r.weights = M.weight_bytes_per_gpu(info, p, tp, pp, gpu, installed) / GIB
        return r

    mem_gib = float(row["gpu_memory_gib"])
    profile = _as_installed(row, profile or profile_for("vllm", str(row.get("vllm_version") or "")))
    tokens, seqs = _batch(row, profile)
    weights, overhead, kv = M.sizes(info, p, tp, pp, kv_dtype, gpu, profile=profile, batch=(tokens, seqs), cold=cold(row))
    captured = 0.0 if row.get("enforce_eager") else M.cuda_graph_bytes_per_gpu(info, tp, pp, seqs)
    graphs = captured if profile.graphs_in_budget else 0.0
    util = float(row["gpu_memory_utilization"])
    budget = util * mem_gib * GIB
    r.weights = weights / GIB
    r.kv = (budget - weights - overhead - graphs) / GIB
    if captured and not profile.graphs_in_budget:  # captured after the cache is sized: out of what the budget leaves
        freed = M.profile_activation_bytes(overhead, profile, tp, pp) \
            if profile.capture_reuses_profile(str(row.get("vllm_version") or "")) else 0.0
        r.capture_ok = captured <= M.capture_headroom(mem_gib * GIB, util, freed)
    context = int(row.get("max_model_len") or info.max_position_embeddings)
    if row.get("kv_cache_gib") is not None:
        r.observed_kv = float(row["kv_cache_gib"])
        r.counted_tokens = M.engine_kv_tokens(kv, r.observed_kv * GIB, context, profile)
    elif row.get("kv_tokens"):
        r.observed_kv = M.engine_kv_bytes(kv, int(row["kv_tokens"]), context, profile) / GIB
    elif row.get("gpu_blocks"):
        r.observed_kv = M.engine_kv_bytes(kv, int(row["gpu_blocks"]) * int(row.get("block_size") or 16), context, profile) / GIB
    r.fits = r.kv > 0 and kv.bytes_for(context) <= r.kv * GIB and r.capture_ok
    r.observed_fits = not row.get("failed_to_start", False)
    return r


def by_profile(results: list[Result]) -> dict[str, list[Result]]:
    """The rows of each vLLM version range (its engine profile), oldest first."""
    from llmgw.engine.profiles import VLLM_PROFILES

    order = {p.name: i for i, p in enumerate(VLLM_PROFILES)}
    out: dict[str, list[Result]] = {}
    for r in sorted(results, key=lambda r: order.get(r.profile, -1)):
        out.setdefault(r.profile, []).append(r)
    return out


def summary(used: list[Result]) -> str:
    """The goal's figures: verdicts, KV within max(10 %, 0.75 GiB), weights within 5 %."""
    kv_rows = [r for r in used if r.kv_ok is not None]
    errs = [abs(r.kv - r.observed_kv) for r in kv_rows]  # type: ignore[operator]
    w = [r for r in used if r.weights_ok is not None]
    v = [r for r in used if r.fits is not None]
    gpus = {str(r.row.get("gpu_class") or "") for r in used if r.row.get("gpu_class")}
    kv_gpus = {str(r.row.get("gpu_class") or "") for r in kv_rows if r.row.get("gpu_class")}
    ranges = {r.profile for r in kv_rows}
    versions = [name for name in by_profile(used) if name != "-"]  # "-": weights-only rows that state no version
    return (f"{len(used)} rows in the set, {len(versions)} vLLM version ranges ({len(ranges)} with a KV row), "
            f"{len(gpus)} GPU classes ({len(kv_gpus)} with a KV row); "
            f"KV within max(10%, {KV_FLOOR_GIB} GiB): {sum(bool(r.kv_ok) for r in kv_rows)} of {len(kv_rows)} "
            f"({sum(bool(r.kv_ok) for r in kv_rows) / max(1, len(kv_rows)):.0%}); KV error mean "
            f"{statistics.mean(errs) if errs else 0:.2f} GiB, worst {max(errs, default=0):.2f} GiB; weights within 5%: "
            f"{sum(bool(r.weights_ok) for r in w)} of {len(w)}; verdicts right: "
            f"{sum(r.fits == r.observed_fits for r in v)} of {len(v)}.")


def _figures(group: list[Result]) -> tuple[str, str, str, str]:
    """A group's KV within, KV error mean / worst, weights within and verdicts right, as table cells."""
    kv_rows = [r for r in group if r.kv_ok is not None]
    errs = [abs(r.kv - r.observed_kv) for r in kv_rows]  # type: ignore[operator]
    w = [r for r in group if r.weights_ok is not None]
    v = [r for r in group if r.fits is not None]
    err = f"{statistics.mean(errs):.2f} / {max(errs):.2f}" if errs else "-"
    return (f"{sum(bool(r.kv_ok) for r in kv_rows)} of {len(kv_rows)}", err, f"{sum(bool(r.weights_ok) for r in w)} of {len(w)}",
            f"{sum(r.fits == r.observed_fits for r in v)} of {len(v)}")


def evaluate_all(path: Path = ROWS) -> list[Result]:
    return [evaluate(row) for row in rows(path)]


# --- the fit of each profile's terms, and leave-one-source-out scoring ---------------------------

COPIES = tuple(i / 4 for i in range(49))  # the sampler's copies tried: 0 to 12, by a quarter
NON_TORCH_MAX_GIB = 0.6


@dataclass(frozen=True)
class Terms:
    """One KV row split into what the fitted terms change: its KV with none of them, the forward pass's
    activation peak (the sampler's dummy pass counts only where it is the larger) and one copy of the
    sampler's logits (max_num_seqs x vocab x fp32), in GiB."""

    result: Result  # the row planned with no sampler pass and nothing outside torch
    fwd: float
    unit: float
    large: bool  # a large card's batch: the profile's large_sampler_copies apply
    source: str

    def kv(self, copies: float, large_copies: float, non_torch: float) -> float:
        c = large_copies if large_copies and self.large else copies
        return float(self.result.kv) + self.fwd - max(self.fwd, c * self.unit) - non_torch  # type: ignore[arg-type]

    @property
    def tolerance(self) -> float:
        return max(0.1 * abs(float(self.result.observed_kv)), KV_FLOOR_GIB)  # type: ignore[arg-type]


def source_of(row: dict[str, Any]) -> str:
    """A row's source for leave-one-out: its GitHub repository (one author's logs are one source), else its site."""
    url = str(row["source"]).removeprefix("https://")
    parts = url.split("/")
    return "/".join(parts[1:3]) if parts[0] == "github.com" else parts[0]


def _zero(profile: Any) -> Any:
    return dataclasses.replace(profile, sampler_copies=0.0, large_sampler_copies=0.0, non_torch_gib=0.0)


def terms(row: dict[str, Any]) -> Terms | None:
    """The row's fit terms; None for a row with no KV figure to fit on."""
    from llmgw.engine.profiles import profile_for
    from llmgw.planner import memory as M

    if row.get("excluded") or row.get("weights_only"):
        return None
    profile = profile_for("vllm", str(row.get("vllm_version") or ""))
    zero = _zero(profile)
    r = evaluate(row, zero)
    if r.observed_kv is None or r.kv is None:
        return None
    info = _info(row)
    tp, pp = int(row.get("tp") or 1), int(row.get("pp") or 1)
    tokens, seqs = _batch(row, zero)
    allreduce = int(profile.allreduce_gib * GIB) if tp * pp > 1 else 0
    fwd = (M.overhead_bytes_per_gpu(info, "vllm", tp, pp, profile=zero, batch=(tokens, seqs), cold=False)
           - M.vision_profile_bytes(info, tokens, tp) - allreduce)
    return Terms(r, fwd / GIB, seqs * info.vocab_size * 4 / GIB, tokens >= profile.large_batch[0], source_of(row))


def fit(ts: list[Terms], large: bool, prior: tuple[float, float], non_torch: float) -> tuple[float, float]:
    """(sampler_copies, large_sampler_copies) minimising the squared KV errors in units of each row's tolerance,
    over the grid ``COPIES``, with memory outside torch held at ``non_torch``. Where the rows cannot tell figures
    apart (the sampler's pass is nowhere the larger), the one nearest ``prior``; no rows: ``prior``."""
    if not ts:
        return prior
    w = [1 / t.tolerance ** 2 for t in ts]
    best: tuple[float, float, tuple[float, float]] | None = None
    for c in COPIES:
        for cl in (COPIES if large else (0.0,)):
            obj = round(sum(wi * (t.kv(c, cl, non_torch) - float(t.result.observed_kv)) ** 2  # type: ignore[arg-type]
                            for wi, t in zip(w, ts, strict=True)), 9)
            near = abs(c - prior[0]) + abs(cl - prior[1])
            if best is None or (obj, near) < best[:2]:
                best = (obj, near, (c, cl))
    assert best is not None
    return best[2]


def non_torch(ts: list[Terms], sources: int = 1) -> float | None:
    """What these rows' own logs print as memory outside torch on a single GPU (the median), None when fewer than
    ``sources`` sources print it: a measured term, not a fitted one (on a split card it holds NCCL's and the
    all-reduce's buffers too)."""
    printed = [(t.source, float(t.result.row["non_torch_gib"])) for t in ts
               if t.result.row.get("non_torch_gib") is not None and int(t.result.row.get("tp") or 1) == 1
               and int(t.result.row.get("pp") or 1) == 1]
    if len({src for src, _ in printed}) < sources or not printed:
        return None
    return round(statistics.median(v for _, v in printed), 2)


def fitted_profiles(ts: Iterable[Terms]) -> dict[str, Any]:
    """Every vLLM profile with its terms fitted on these rows: memory outside torch as its logs print it where two
    sources or more do (else as all the rows' logs do), then the sampler's copies, what its rows cannot tell
    apart taken from the neighbouring version ranges' fit."""
    from llmgw.engine.profiles import VLLM_PROFILES, profile_for

    groups: dict[str, list[Terms]] = {}
    pool = list(ts)
    for t in pool:
        groups.setdefault(profile_for("vllm", str(t.result.row.get("vllm_version"))).name, []).append(t)
    pooled_nt = non_torch(pool) or 0.0
    out = {}
    for i, p in enumerate(VLLM_PROFILES):
        group = groups.get(p.name, [])
        nt = non_torch(group, sources=2)  # one source's figure would be a factor only its own rows support
        nt = pooled_nt if nt is None else nt
        # What the rows cannot tell apart takes the neighbouring version ranges' fit: the code changes by version.
        near = [t for q in VLLM_PROFILES[max(0, i - 1):i + 2] if q is not p for t in groups.get(q.name, [])]
        c0, _ = fit(near or pool, False, (0.0, 0.0), pooled_nt)
        c, cl = fit(group, bool(p.large_sampler_copies), (c0, c0), nt)
        out[p.name] = dataclasses.replace(p, sampler_copies=c, large_sampler_copies=cl, non_torch_gib=nt)
    return out


def leave_one_source_out(path: Path = ROWS) -> list[Result]:
    """Every row planned with its profile's terms fitted on the rows of every other source."""
    from llmgw.engine.profiles import profile_for

    all_rows = rows(path)
    ts = [t for t in (terms(row) for row in all_rows) if t is not None]
    fits: dict[str, dict[str, Any]] = {}
    out = []
    for row in all_rows:
        if row.get("excluded") or row.get("weights_only"):
            out.append(evaluate(row))
            continue
        src = source_of(row)
        if src not in fits:
            fits[src] = fitted_profiles(t for t in ts if t.source != src)
        out.append(evaluate(row, fits[src][profile_for("vllm", str(row.get("vllm_version") or "")).name]))
    return out


def fit_table(path: Path = ROWS) -> str:
    """Markdown: each profile's fitted terms on the whole set beside what llmgw/engine/profiles.py holds."""
    from llmgw.engine.profiles import VLLM_PROFILES

    fitted = fitted_profiles(t for t in (terms(row) for row in rows(path)) if t is not None)
    out = ["| vLLM profile | sampler copies fit / held | large-batch copies fit / held | non-torch GiB fit / held |",
           "|---|---|---|---|"]
    for p in VLLM_PROFILES:
        f = fitted[p.name]
        out.append(f"| {p.name} | {f.sampler_copies:g} / {p.sampler_copies:g} | {f.large_sampler_copies:g} / "
                   f"{p.large_sampler_copies:g} | {f.non_torch_gib:g} / {p.non_torch_gib:g} |")
    return "\n".join(out)


def table(results: list[Result], held_out: list[Result] | None = None) -> str:
    """Markdown: every row in the set with its errors, then the excluded ones, then the summary."""
    out = ["| model | GPU | tp | util | vLLM (profile) | weights GiB pred / obs | KV GiB pred / obs | KV error | fits pred / obs |",
           "|---|---|---|---|---|---|---|---|---|"]
    used = [r for r in results if not r.excluded]
    for r in used:
        row = r.row
        if r.kv is None:
            out.append(f"| {row['model']} | {row.get('gpu_class') or row.get('gpu') or '-'} | {row.get('tp') or 1} | - | "
                       f"{row.get('vllm_version') or '-'} | {r.weights:.2f} / {row['weights_gib']:.2f} | - | - | - |")
            continue
        obs_w = f"{row['weights_gib']:.2f}" if row.get("weights_gib") is not None else "-"
        obs_kv = f"{r.observed_kv:.2f}" if r.observed_kv is not None else "-"
        err = f"{r.kv - r.observed_kv:+.2f}" if r.kv is not None and r.observed_kv is not None else "-"
        out.append(f"| {row['model']} | {row.get('gpu_class') or row.get('gpu')} | {row.get('tp') or 1} | "
                   f"{row['gpu_memory_utilization']:g} | {row.get('vllm_version') or '-'} ({r.profile}) | {r.weights:.2f} / {obs_w} | "
                   f"{r.kv:.2f} / {obs_kv} | {err} | {'yes' if r.fits else 'no'} / {'yes' if r.observed_fits else 'no'} |")
    out.append("")
    out.append("In sample: " + summary(used))
    held = [r for r in held_out if not r.excluded] if held_out is not None else []
    if held:
        out.append("")
        out.append("Leave one source out: " + summary(held))
    out.append("")
    out.append("| vLLM profile | rows | KV within max(10%, 0.75 GiB) | KV error mean / worst GiB | weights within 5% | "
               "verdicts right |" + (" LOSO: KV within | LOSO: KV error mean / worst GiB | LOSO: verdicts right |" if held else ""))
    out.append("|---|---|---|---|---|---|" + ("---|---|---|" if held else ""))
    held_groups = by_profile(held)
    for name, group in by_profile(used).items():
        line = f"| {name} | {len(group)} | " + " | ".join(_figures(group))
        if held:
            kv, err, _, verdicts = _figures(held_groups.get(name, []))
            line += f" | {kv} | {err} | {verdicts}"
        out.append(line + " |")
    out.append("")
    out.append("Excluded: " + "; ".join(f"{r.row['model']} ({r.excluded})" for r in results if r.excluded) + ".")
    return "\n".join(out)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    args = [a for a in sys.argv[1:] if a != "--fit"]
    source = Path(args[0]) if args else ROWS
    if "--fit" in sys.argv[1:]:
        print(fit_table(source))
    else:
        print(table(evaluate_all(source), leave_one_source_out(source)))
