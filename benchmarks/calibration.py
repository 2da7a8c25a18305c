"""The planner's memory model against vLLM's own start-up logs: predicted vs observed weights and KV cache.

    python benchmarks/calibration.py            # the markdown table docs/planning.md quotes
    python benchmarks/calibration.py ROWS.jsonl # the same for other rows (a candidate's, before it joins)

Rows are ``tests/data/vllm_observed.jsonl``: figures vLLM printed at start-up
(``Model loading took X GiB``, ``Available KV cache memory: Y GiB``, ``GPU KV cache
size: N tokens``, ``# GPU blocks``), each with its public source. A row is in the
calibration set when it ran vLLM's V1 engine with a known card size and
``gpu_memory_utilization``, and its model's config.json is here (``config``:
a folder under ``examples/models`` or ``tests/data/calibration``, optionally with a
``quantization_config`` laid over it); the others are listed with why not.
"""

from __future__ import annotations

import json
import statistics
import sys
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


def evaluate(row: dict[str, Any]) -> Result:
    """One row: what the planner predicts for its model, card, split and settings, next to what vLLM printed."""
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
    if row.get("weights_only"):  # the log gives the weights alone (no card size or KV figure)
        r.weights = M.weight_bytes_per_gpu(info, p, tp, pp, gpu) / GIB
        return r
    from llmgw.engine.profiles import profile_for

    mem_gib = float(row["gpu_memory_gib"])
    profile = profile_for("vllm", str(row.get("vllm_version") or ""))
    tokens, seqs = profile.batch(gpu, int(mem_gib * 1024))
    if row.get("max_num_seqs"):
        seqs = int(row["max_num_seqs"])
        tokens = max(tokens, seqs)
    if row.get("max_num_batched_tokens"):
        tokens = int(row["max_num_batched_tokens"])
    weights, overhead, kv = M.sizes(info, p, tp, pp, kv_dtype, gpu, profile=profile, batch=(tokens, seqs))
    graphs = M.cuda_graph_bytes_per_gpu(info, tp, pp, seqs) if profile.graphs_in_budget and not row.get("enforce_eager") else 0.0
    budget = float(row["gpu_memory_utilization"]) * mem_gib * GIB
    r.weights = weights / GIB
    r.kv = (budget - weights - overhead - graphs) / GIB
    per_token = kv.bytes_per_token
    if row.get("kv_cache_gib") is not None:
        r.observed_kv = float(row["kv_cache_gib"])
    elif row.get("kv_tokens"):
        r.observed_kv = int(row["kv_tokens"]) * per_token / GIB
    elif row.get("gpu_blocks"):
        r.observed_kv = int(row["gpu_blocks"]) * int(row.get("block_size") or 16) * per_token / GIB
    context = int(row.get("max_model_len") or info.max_position_embeddings)
    r.fits = r.kv > 0 and kv.bytes_for(context) <= r.kv * GIB
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


def evaluate_all(path: Path = ROWS) -> list[Result]:
    return [evaluate(row) for row in rows(path)]


def table(results: list[Result]) -> str:
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
    out.append(summary(used))
    out.append("")
    out.append("| vLLM profile | rows | KV within max(10%, 0.75 GiB) | KV error mean / worst GiB | weights within 5% | verdicts right |")
    out.append("|---|---|---|---|---|---|")
    for name, group in by_profile(used).items():
        kv_rows = [r for r in group if r.kv_ok is not None]
        errs = [abs(r.kv - r.observed_kv) for r in kv_rows]  # type: ignore[operator]
        w = [r for r in group if r.weights_ok is not None]
        v = [r for r in group if r.fits is not None]
        err = f"{statistics.mean(errs):.2f} / {max(errs):.2f}" if errs else "-"
        out.append(f"| {name} | {len(group)} | {sum(bool(r.kv_ok) for r in kv_rows)} of {len(kv_rows)} | {err} | "
                   f"{sum(bool(r.weights_ok) for r in w)} of {len(w)} | {sum(r.fits == r.observed_fits for r in v)} of {len(v)} |")
    out.append("")
    out.append("Excluded: " + "; ".join(f"{r.row['model']} ({r.excluded})" for r in results if r.excluded) + ".")
    return "\n".join(out)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(table(evaluate_all(Path(sys.argv[1]) if len(sys.argv) > 1 else ROWS)))
