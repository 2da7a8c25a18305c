"""A model read, never retyped: its config.json, and its parameter count from the checkpoint.

MODEL is a local directory holding config.json, ``Org/Name`` found as
``Org__Name`` under a models directory (``--models-dir``, ``LLMGW_MODELS_DIR``),
or a Hugging Face repo id resolved with huggingface_hub, from the cache alone
when ``HF_HUB_OFFLINE=1`` or the network fails. The parameter count comes from,
in order: ``--params``; the safetensors index's ``metadata.total_size``; the
``.safetensors`` headers; the Hub's safetensors metadata; the architecture.

Over 600 lines: every checkpoint format's quantization config (GPTQ, AWQ, compressed-tensors,
ModelOpt, mxfp4, GGUF) is read here and nowhere else, so that no figure is ever typed twice.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlparse

import msgspec

from llmgw.engine.argv import is_repo_id
from llmgw.errors import ModelError
from llmgw.messages import ModelInfo
from llmgw.planner.memory import architecture_params

__all__ = ["ModelInfo", "from_config", "load", "parse_params", "hf_cache_dir"]

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float": 4, "half": 2}
_MAX_HEADER = 100 * 1024**2
MAX_PARAMS = 10**16  # 10 quadrillion: messages.PlanRequest's bound
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "max_position_embeddings")


def parse_params(text: str) -> int:
    """``70.6B``, ``7e9``, ``8030261248`` or ``560M`` as a parameter count."""
    s = text.strip().replace("_", "").replace(",", "")
    mult = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(s[-1:].lower(), 1.0) if s else 1.0
    if mult != 1.0:
        s = s[:-1]
    try:
        value = float(s) * mult
    except ValueError as e:
        raise ModelError(f"--params {text!r} is not a parameter count; write e.g. 70.6B, 7e9 or 8030261248") from e
    if not 1 <= value <= MAX_PARAMS:  # also refuses inf and nan
        raise ModelError(f"--params must be a parameter count from 1 to {MAX_PARAMS:.0e} (got {text!r})")
    return int(value)


def _sliding_layers(cfg: dict[str, Any], n: int) -> tuple[int, ...]:
    window = cfg.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        return ()
    if isinstance(cfg.get("layer_types"), list):
        return tuple(i for i, t in enumerate(cfg["layer_types"]) if t == "sliding_attention")
    mt = cfg.get("model_type", "")
    if mt == "gemma2":
        return tuple(range(0, n, 2))  # even layers attend locally, odd layers globally
    if mt == "gemma3":
        pattern = int(cfg.get("sliding_window_pattern", 6))
        return tuple(i for i in range(n) if (i + 1) % pattern)
    if cfg.get("use_sliding_window") is False:
        return ()
    if mt in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        start = int(cfg.get("max_window_layers", n))
        return tuple(range(start, n))
    return tuple(range(n))  # Mistral-style: every layer slides


# Keys only state-space (mamba) hybrids state: Jamba, Nemotron-H, Falcon-H1, Granite 4, Zamba.
_MAMBA_KEYS = ("hybrid_override_pattern", "attn_layer_period", "mamba_d_state", "mamba_d_ssm", "ssm_state_size",
               "mamba_n_heads", "mamba_expand")
_ATTENTION_TYPES = ("full_attention", "sliding_attention", "attention")


def _positive(cfg: dict[str, Any], key: str) -> int:
    v = cfg.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def _linear_layers(cfg: dict[str, Any], n: int, name: str, where: str) -> tuple[int, ...]:
    """Indices of the gated delta-net (linear attention) layers; a layer kind the planner cannot size is refused."""
    if any(k in cfg for k in _MAMBA_KEYS) or any("mamba" in str(t) for t in cfg.get("layer_types") or []):
        raise ModelError(f"{where} of {name} states mamba (state-space) layers; the planner sizes attention, "
                         "sliding-window and gated delta-net layers only, and would get this model's memory wrong")
    types = cfg.get("layer_types")
    if isinstance(types, list):
        unknown = sorted({str(t) for t in types} - {*_ATTENTION_TYPES, "linear_attention"})
        if unknown:
            raise ModelError(f"{where} of {name} has layers of kind {', '.join(unknown)[:200]}; the planner sizes "
                             f"{', '.join(_ATTENTION_TYPES)} and linear_attention (gated delta-net) layers only")
        return tuple(i for i, t in enumerate(types[:n]) if t == "linear_attention")
    interval = _positive(cfg, "full_attention_interval")  # Qwen3-Next: every interval-th layer attends fully
    if interval and _positive(cfg, "linear_num_value_heads"):
        return tuple(i for i in range(n) if (i + 1) % interval)
    return ()


# The largest item vLLM profiles the tower with: an image of up to 16,384 merged tokens for Qwen2-VL …
# Qwen3.5 ("profiled with 1 image items", Qwen3.5-9B under vLLM 0.18), a video of 153,600 for Qwen3-VL
# ("a budget of 153600 tokens, and profiled with 1 video items", Qwen3-VL-30B-A3B under vLLM 0.11).
QWEN_VL_ITEM_TOKENS = 16384
QWEN3_VL_VIDEO_TOKENS = 153_600


class _Vision(NamedTuple):
    params: int = 0
    item_tokens: int = 0  # 0: vLLM's profiling of the tower is not modelled for it
    item_patches: int = 0
    patch_width: int = 0


def _vision(vc: Any, text_hidden: int) -> _Vision:
    """The vision tower, from a multimodal config's ``vision_config`` (a ViT: blocks, patch embedding,
    positions and the merger into the language model): its parameters and, for the Qwen-VL family's
    towers, what vLLM's profiling pushes through it; nothing when the config does not say enough."""
    if not isinstance(vc, dict):
        return _Vision()
    d = _positive(vc, "hidden_size") or _positive(vc, "embed_dim")
    depth = _positive(vc, "depth") or _positive(vc, "num_hidden_layers")
    inner = _positive(vc, "intermediate_size")
    if not (d and depth and inner):
        return _Vision()
    gated = str(vc.get("hidden_act", "")) in ("silu", "swiglu")  # Qwen2.5-VL, Pixtral: gate, up, down
    block = 4 * d * d + 4 * d + (3 if gated else 2) * d * inner + inner + 5 * d
    patch = _positive(vc, "patch_size") or 14
    embed = (_positive(vc, "in_channels") or _positive(vc, "num_channels") or 3) * (_positive(vc, "temporal_patch_size") or 1) \
        * patch * patch * d
    image = _positive(vc, "image_size")
    positions = (_positive(vc, "num_position_embeddings") or (image // patch) ** 2) * d
    merge = _positive(vc, "spatial_merge_size") or 1
    out = _positive(vc, "out_hidden_size") or text_hidden
    merged = d * merge * merge
    mergers = 1 + len(vc.get("deepstack_visual_indexes") or [])
    merger = mergers * (merged * merged + merged * out) if merge > 1 else d * out
    params = depth * block + embed + positions + merger
    if merge > 1 and _positive(vc, "temporal_patch_size"):  # the Qwen-VL family
        item = QWEN3_VL_VIDEO_TOKENS if str(vc.get("model_type", "")).startswith("qwen3_vl") else QWEN_VL_ITEM_TOKENS
        return _Vision(params, item, item * merge * merge, 3 * d + inner)
    return _Vision(params)


def from_config(cfg: dict[str, Any], *, name: str, source: str, where: str = "config.json") -> ModelInfo:
    """The architecture a config.json states; parameter count left at 0."""
    vision_config = cfg.get("vision_config")
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers keep the LM in text_config
        cfg = {**cfg, **cfg["text_config"]}
    missing = [k for k in _REQUIRED if isinstance(cfg.get(k), bool) or not isinstance(cfg.get(k), int) or cfg[k] <= 0]
    experts = int(cfg.get("num_local_experts") or cfg.get("n_routed_experts") or cfg.get("num_experts") or 0)
    if not isinstance(cfg.get("intermediate_size"), int) and not (experts and cfg.get("moe_intermediate_size")):
        missing.append("intermediate_size")
    if missing:
        raise ModelError(
            f"{where} of {name} lacks {', '.join(missing)} (or has them not as positive integers); the planner reads decoder-only transformer "
            "configs: point MODEL at a directory with the model's complete config.json"
        )
    h, heads, n = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    kv_heads = cfg.get("num_key_value_heads")
    if kv_heads is None:
        kv_heads = heads  # no grouping stated: multi-head attention
    elif isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or not 0 < kv_heads <= heads or heads % kv_heads:
        raise ModelError(f"{where} of {name} states num_key_value_heads = {kv_heads!r} for {heads} attention heads; "
                         "it must be a positive number of KV heads that groups them evenly (at most one per attention "
                         "head): point MODEL at the model's own config.json")
    head_dim: int = cfg["head_dim"] if isinstance(cfg.get("head_dim"), int) else h // heads
    window = cfg.get("sliding_window") if isinstance(cfg.get("sliding_window"), int) else None
    sliding = _sliding_layers(cfg, n)
    if window is not None and (window >= cfg["max_position_embeddings"] or not sliding):
        window, sliding = None, ()
    q = quantization(stated_quantization(cfg), name)
    if q.precision == "mxfp4" and not experts:
        raise ModelError(f"{name}: an mxfp4 checkpoint without MoE experts; vLLM runs mxfp4 only in MoE experts (gpt-oss)")
    mt = str(cfg.get("model_type", ""))
    linear = _linear_layers(cfg, n, name, where)
    if linear and not all(_positive(cfg, k) for k in ("linear_num_key_heads", "linear_num_value_heads",
                                                      "linear_key_head_dim", "linear_value_head_dim")):
        raise ModelError(f"{where} of {name} has linear-attention layers but not their sizes (linear_num_key_heads, "
                         "linear_num_value_heads, linear_key_head_dim, linear_value_head_dim); point MODEL at the "
                         "model's own config.json")
    shared = _positive(cfg, "n_shared_experts")
    if experts and not shared and _positive(cfg, "shared_expert_intermediate_size"):  # Qwen2-MoE, Qwen3-Next, Qwen3.5
        mi = _positive(cfg, "moe_intermediate_size") or _positive(cfg, "intermediate_size") or 1
        shared = -(-cfg["shared_expert_intermediate_size"] // mi)
    gate_default = mt.startswith(("qwen3_next", "qwen3_5"))
    vision = _vision(vision_config, h)
    full_head_dim = _positive(cfg, "global_head_dim")
    full_kv = _positive(cfg, "num_global_key_value_heads") if cfg.get("attention_k_eq_v") is True else 0
    if full_kv and (heads % full_kv or full_kv > heads):
        raise ModelError(f"{where} of {name} states num_global_key_value_heads = {full_kv} for {heads} attention "
                         "heads; it must group them evenly: point MODEL at the model's own config.json")
    ple = _positive(cfg, "hidden_size_per_layer_input")  # per-layer embeddings (Gemma 3n, small Gemma 4)
    shared_kv = _positive(cfg, "num_kv_shared_layers")
    if shared_kv >= n:
        raise ModelError(f"{where} of {name} shares the KV cache of {shared_kv} of its {n} layers; at least one "
                         "layer must keep its own: point MODEL at the model's own config.json")
    try:
        info = ModelInfo(
            name=name,
            source=source,
            model_type=mt,
            architecture=(cfg.get("architectures") or [""])[0],
            hidden_size=h,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_layers=n,
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg["max_position_embeddings"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            attention_bias=bool(cfg.get("attention_bias", mt in ("qwen2", "qwen2_moe"))),
            sliding_window=window,
            sliding_layers=sliding,
            num_experts=experts,
            experts_per_token=int(cfg.get("num_experts_per_tok") or cfg.get("top_k_experts") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0) if experts else 0,
            shared_experts=shared,
            first_dense_layers=int(cfg.get("first_k_dense_replace") or 0),
            q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
            qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
            v_head_dim=int(cfg.get("v_head_dim") or 0),
            attn_output_gate=bool(cfg.get("attn_output_gate", gate_default)),
            full_head_dim=full_head_dim if full_head_dim != head_dim else 0,
            full_kv_heads=full_kv if full_kv != kv_heads else 0,
            kv_shared_layers=shared_kv,
            dense_and_moe=bool(experts and (cfg.get("enable_moe_block") is True or cfg.get("use_second_mlp_block") is True)),
            double_wide_shared=bool(shared_kv and cfg.get("use_double_wide_mlp") is True),
            per_layer_input_size=ple,
            per_layer_vocab=(_positive(cfg, "vocab_size_per_layer_input") or cfg["vocab_size"]) if ple else 0,
            linear_layers=linear,
            linear_qk_heads=_positive(cfg, "linear_num_key_heads") if linear else 0,
            linear_value_heads=_positive(cfg, "linear_num_value_heads") if linear else 0,
            linear_qk_head_dim=_positive(cfg, "linear_key_head_dim") if linear else 0,
            linear_value_head_dim=_positive(cfg, "linear_value_head_dim") if linear else 0,
            linear_conv_kernel=(_positive(cfg, "linear_conv_kernel_dim") or 4) if linear else 0,
            linear_state_bytes=(4 if str(cfg.get("mamba_ssm_dtype", "")) in ("float32", "float") else 2) if linear else 0,
            vision_params=vision.params,
            vision_item_tokens=vision.item_tokens,
            vision_item_patches=vision.item_patches,
            vision_patch_width=vision.patch_width,
            quantization=q.precision,
            quant_bits=q.bits,
            quant_ignore=q.ignore,
            quant_format=q.format,
            kv_cache_dtype=q.kv_cache_dtype,
        )
    except (TypeError, ValueError, OverflowError) as e:  # a field of the wrong kind: "abc", [], 1e999
        raise ModelError(f"{where} of {name} holds a value of the wrong kind ({e}); point MODEL at the model's "
                         "own config.json") from None
    try:  # the bounds messages.ModelInfo sets for what travels to the planner
        return msgspec.convert(msgspec.to_builtins(info), ModelInfo)
    except msgspec.ValidationError as e:
        raise ModelError(f"{where} of {name}: {e} is not what a model states; point MODEL at the model's own "
                         "config.json") from None


class Quantization(msgspec.Struct, frozen=True):
    """What a pre-quantized checkpoint's quantization_config says, as the planner needs it."""

    precision: str | None = None
    bits: float = 0.0  # per quantized weight, scales and zero points included (per-row ones left to the planner)
    ignore: tuple[str, ...] = ()
    format: str = ""
    kv_cache_dtype: str = ""


SUPPORTED_QUANT = "compressed-tensors (fp8, int8, int4, fp4), ModelOpt (FP8, NVFP4), fp8, mxfp4 (gpt-oss), awq, gptq and bitsandbytes"


def _num(d: dict[str, Any], key: str, default: float) -> float:
    v = d.get(key, default)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else default


def _names(value: Any) -> tuple[str, ...]:
    return tuple(str(x) for x in value) if isinstance(value, list) else ()


def quantization(qc: Any, name: str) -> Quantization:
    """The checkpoint's quantization, from its config's ``quantization_config``; a method we cannot size is refused."""
    if not qc:
        return Quantization()
    if not isinstance(qc, dict):
        raise ModelError(f"{name}: quantization_config is not an object; check the model's config.json")
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(qc, name)
    if method == "modelopt":
        return _modelopt(qc, name)
    if method == "fp8":
        # Per-tensor or per-block (DeepSeek-V3: 128 x 128) scales: a few bits per million weights.
        block = qc.get("weight_block_size")
        per = block[0] * block[1] if isinstance(block, list) and len(block) == 2 and all(isinstance(x, int) and x > 0 for x in block) else 0
        ignore = _names(qc.get("ignored_layers")) + _names(qc.get("modules_to_not_convert"))
        kv = "fp8" if qc.get("kv_cache_scheme") else ""  # AMD's …-FP8-KV: "static", with scales in the checkpoint
        return Quantization("fp8", 8 + (32 / per if per else 0.0), ignore, "fp8", kv)
    if method == "mxfp4":
        # gpt-oss: MoE experts in fp4 with an e8m0 scale per 32; attention, router, embeddings stay bf16.
        return Quantization("mxfp4", 4 + 8 / 32, _names(qc.get("modules_to_not_convert")), "mxfp4")
    if method in ("awq", "gptq"):
        bits = _num(qc, "bits", _num(qc, "w_bit", 4))
        group = _num(qc, "group_size", _num(qc, "q_group_size", 128))
        if bits not in (2, 3, 4, 8):
            raise ModelError(f"{name}: {method} with {bits:g} bits; the planner sizes 2, 3, 4 and 8-bit {method} checkpoints")
        # A 16-bit scale and a packed zero point per group (per output row when group_size is -1).
        extra = (16 + bits) / group if group > 0 else 0.0
        return Quantization(method, bits + extra, _names(qc.get("modules_to_not_convert")), method)
    if method == "bitsandbytes":
        skip = _names(qc.get("llm_int8_skip_modules"))
        if qc.get("load_in_4bit"):
            # Blocks of 64 with an fp32 absmax; double quantization stores it in 8 bits (+ fp32 per 256 blocks).
            extra = (8 / 64 + 32 / (64 * 256)) if qc.get("bnb_4bit_use_double_quant") else 32 / 64
            return Quantization("bnb-4bit", 4 + extra, skip, "bitsandbytes")
        if qc.get("load_in_8bit"):
            return Quantization("bnb-8bit", 8.0, skip, "bitsandbytes")
        raise ModelError(f"{name}: a bitsandbytes config with neither load_in_4bit nor load_in_8bit; check its config.json")
    raise ModelError(f"{name} is a {method or 'quantized (no quant_method)'} checkpoint, which the planner cannot size; "
                     f"it sizes {SUPPORTED_QUANT} checkpoints: plan the 16-bit repository it was made from "
                     "(with --precision fp8 or a GGUF precision), or pass --params with that repository's count")


def _compressed_tensors(qc: dict[str, Any], name: str) -> Quantization:
    groups = qc.get("config_groups") or {}
    weights = next((g.get("weights") for g in groups.values() if isinstance(g, dict) and isinstance(g.get("weights"), dict)), None) \
        if isinstance(groups, dict) else None
    if weights is None:
        raise ModelError(f"{name}: a compressed-tensors config with no weight scheme in config_groups; check its config.json")
    bits = _num(weights, "num_bits", 0)
    kind = str(weights.get("type", "int")).lower()
    label = {("float", 8): "fp8", ("int", 8): "int8", ("int", 4): "int4", ("float", 4): "fp4"}.get((kind, int(bits)))
    if label is None:
        raise ModelError(f"{name}: compressed-tensors weights of {bits:g}-bit {kind}; the planner sizes "
                         "8-bit float or int, 4-bit int and 4-bit float weights")
    # ModelOpt's copy of the scheme states a group_size and no strategy: grouped.
    strategy = str(weights.get("strategy", "group" if _num(weights, "group_size", 0) > 0 else "tensor")).lower()
    extra = 0.0
    if strategy == "group":
        group = _num(weights, "group_size", 128)
        scale_bits = 8 if label == "fp4" else 16  # NVFP4 keeps an fp8 scale per 16 weights
        extra = (scale_bits + (0 if weights.get("symmetric", True) else bits)) / max(group, 1)
    kv = qc.get("kv_cache_scheme")
    kv_dtype = "fp8" if isinstance(kv, dict) and int(_num(kv, "num_bits", 16)) == 8 and kv.get("type") == "float" else ""
    return Quantization(label, bits + extra, _names(qc.get("ignore")), "compressed-tensors", kv_dtype)


def _modelopt(qc: dict[str, Any], name: str) -> Quantization:
    """NVIDIA ModelOpt checkpoints (nvidia/…-FP8, …-NVFP4): newer ones state a compressed-tensors-like
    ``config_groups``; older ones only ``quant_algo`` (FP8, NVFP4: 4-bit floats with an fp8 scale per 16)."""
    ignore = _names(qc.get("ignore")) + _names(qc.get("exclude_modules"))
    kv_algo = str(qc.get("kv_cache_quant_algo") or "").upper()
    if isinstance(qc.get("config_groups"), dict) and qc["config_groups"]:
        q = _compressed_tensors(qc, name)
        return msgspec.structs.replace(q, ignore=ignore, format="modelopt",
                                       kv_cache_dtype=q.kv_cache_dtype or ("fp8" if kv_algo == "FP8" else ""))
    algo = str(qc.get("quant_algo") or "").upper()
    kv = "fp8" if kv_algo == "FP8" or isinstance(qc.get("kv_cache_scheme"), dict) else ""
    if algo == "FP8":
        return Quantization("fp8", 8.0, ignore, "modelopt", kv)
    if algo == "NVFP4":
        group = _num(qc, "group_size", 16)
        return Quantization("fp4", 4 + 8 / max(group, 1), ignore, "modelopt", kv)
    raise ModelError(f"{name}: a ModelOpt checkpoint of {algo or 'no stated'} quant_algo; the planner sizes its FP8 and "
                     "NVFP4 checkpoints")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ModelError(f"{path} cannot be read as JSON ({e}); replace it with the model's own file") from e
    except RecursionError:
        raise ModelError(f"{path} is nested too deeply to be a config; replace it with the model's own file") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path} is not a JSON object; replace it with the model's own file")
    return data


def params_from_index(index: dict[str, Any], info: ModelInfo) -> int | None:
    """``metadata.total_size`` over the checkpoint's bytes per parameter; None for quantized checkpoints."""
    total = (index.get("metadata") or {}).get("total_size")
    if not isinstance(total, int) or total <= 0 or info.quantization:
        return None  # packed or mixed-width weights: bytes are not parameters
    return total // _DTYPE_BYTES.get(info.torch_dtype, 2)


def params_from_headers(files: list[Path]) -> int | None:
    """Elements in every tensor of .safetensors files, read from their headers only."""
    total = 0
    for f in files:
        try:
            with f.open("rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                if size > _MAX_HEADER:
                    return None
                header = json.loads(fh.read(size))
        except (OSError, struct.error, ValueError, RecursionError):
            return None
        for key, t in header.items():
            if key != "__metadata__" and isinstance(t, dict):
                n = 1
                for d in t.get("shape", []):
                    n *= int(d)
                total += n
    return total or None


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (not at import)."""
    if env := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env)
    home = os.environ.get("HF_HOME") or str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface")
    return Path(home) / "hub"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


# The Hub, bounded: huggingface_hub retries a failed request five times with back-off
# (~24 s when the network is down), and a planner answering plans must not wait that
# long, nor make every other request wait behind it.
HUB_PROBE_S = 2.0  # connecting to the Hub (or the proxy): longer is "unreachable"
HUB_LOOKUP_S = 3.0  # a whole lookup of a repository's files on the Hub
MISS_TTL_S = 60.0  # how long a model that could not be found stays "not found"
_probe: tuple[float, bool] | None = None
_misses: dict[str, tuple[float, str]] = {}
_lock = threading.Lock()
_hub_pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="llmgw-hub")


def hub_reachable() -> bool:
    """Whether a TCP connection to the Hub (or the HTTPS proxy) opens within HUB_PROBE_S; kept a minute."""
    global _probe
    now = time.monotonic()
    with _lock:
        if _probe is not None and now - _probe[0] < MISS_TTL_S:
            return _probe[1]
    from huggingface_hub import constants

    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlparse(proxy or constants.ENDPOINT)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)

    def connect() -> bool:
        try:
            socket.create_connection((host, port), timeout=HUB_PROBE_S).close()
            return True
        except OSError:
            return False

    try:  # the name lookup has no timeout of its own: bound it from outside
        ok = bool(host) and _hub_pool.submit(connect).result(timeout=HUB_PROBE_S * 1.5)
    except concurrent.futures.TimeoutError:
        ok = False
    with _lock:
        _probe = (time.monotonic(), ok)
    return ok


def _missed(model: str) -> str | None:
    with _lock:
        hit = _misses.get(model)
        if hit is not None and time.monotonic() - hit[0] < MISS_TTL_S:
            return hit[1]
        _misses.pop(model, None)
    return None


def _remember_miss(model: str, why: str) -> None:
    with _lock:
        if len(_misses) > 1024:
            _misses.clear()
        _misses[model] = (time.monotonic(), why)


def _hf_file(repo: str, filename: str, offline: bool) -> Path | None:
    """A file of a repo from the cache (or the Hub when online); None when the repo has no such file."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        return Path(hf_hub_download(repo, filename, cache_dir=hf_cache_dir(), local_files_only=offline))
    except GatedRepoError as e:
        raise ModelError(f"{repo} is gated on the Hugging Face Hub; accept its licence and log in "
                         "(`hf auth login`), or pass a local directory with its config.json") from e
    except RepositoryNotFoundError as e:
        raise ModelError(f"{repo} is not a Hugging Face repository (or it is private); check the name, "
                         "or pass a local directory with its config.json") from e
    except EntryNotFoundError:
        return None
    except LocalEntryNotFoundError:
        if offline:
            return None
        return _hf_file(repo, filename, True)  # the network failed: the cache may still have it
    except OSError:
        return None if offline else _hf_file(repo, filename, True)


def _hub_params(repo: str) -> int | None:
    try:
        from huggingface_hub import get_safetensors_metadata

        meta = get_safetensors_metadata(repo)
        return int(sum(meta.parameter_count.values())) or None
    except Exception:  # noqa: BLE001 - any failure here means "ask the architecture"
        return None


def _finish(info: ModelInfo, params: int | None, source: str) -> ModelInfo:
    if params:
        return msgspec.structs.replace(info, params=params, params_source=source)
    return msgspec.structs.replace(info, params=architecture_params(info), params_source="architecture")


def stated_quantization(cfg: dict[str, Any]) -> Any:
    """The quantization section a config.json states (older llm-compressor checkpoints name it
    compression_config), or None."""
    return cfg.get("quantization_config") or cfg.get("compression_config")


def with_hf_quant_config(cfg: dict[str, Any], quant: Path | None) -> dict[str, Any]:
    """A config.json with the quantization an older NVIDIA ModelOpt checkpoint states beside it, in
    ``hf_quant_config.json`` (as vLLM reads it), when the config itself states none."""
    if quant is None or stated_quantization(cfg) or not quant.is_file():
        return cfg
    section = _read_json(quant).get("quantization")
    if not isinstance(section, dict):
        return cfg
    return {**cfg, "quantization_config": {"quant_method": "modelopt", **section}}


def load_dir(path: Path, *, name: str | None = None, source: str | None = None, params: int | None = None) -> ModelInfo:
    """A model from a directory holding config.json (and maybe an index or .safetensors files)."""
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelError(f"{path} has no config.json; download the model's config.json into it, "
                         "or name a Hugging Face repo id")
    # A folder named Org__Name (as in examples/models) stands for the repo Org/Name.
    default_name = path.resolve().name.replace("__", "/", 1)
    # Absolute: engines run on other nodes, from another working directory, than the one planned in.
    cfg = with_hf_quant_config(_read_json(cfg_path), path / "hf_quant_config.json")
    info = from_config(cfg, name=name or default_name, source=source or str(path.resolve()), where=str(cfg_path))
    if params:
        return _finish(info, params, "--params")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        n = params_from_index(_read_json(index), info)
        if n:
            return _finish(info, n, "safetensors-index")
    files = sorted(path.glob("*.safetensors"))
    if files and not info.quantization:
        return _finish(info, params_from_headers(files), "safetensors-header")
    return _finish(info, None, "")


def models_dir(explicit: str | Path | None = None) -> Path | None:
    d = explicit or os.environ.get("LLMGW_MODELS_DIR")
    return Path(d) if d else None


def _shown(model: str) -> str:
    return repr(model) if len(model) <= 80 else f"{model[:60]!r}… ({len(model):,} characters)"


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a name too long for this file system (ENAMETOOLONG), a NUL byte
        return False


def local_dir(model: str, models_dir_: Path | None) -> Path | None:
    """The directory ``model`` is read from here: itself, or ``Org__Name`` under ``models_dir_``; None: not here.

    A ``model`` that cannot be a path at all (too long, a NUL byte) is a ModelError.
    """
    local = Path(model).expanduser()
    try:
        if local.is_dir():
            return local
    except (OSError, ValueError) as e:  # a name too long (ENAMETOOLONG), a NUL byte
        raise ModelError(f"{_shown(model)} cannot be a model directory ({getattr(e, 'strerror', None) or e}); "
                         "give a shorter path or a Hugging Face repo id (Org/Name)") from None
    if models_dir_ is not None and is_repo_id(model):
        candidate = models_dir_ / model.replace("/", "__")
        if _is_file(candidate / "config.json"):
            return candidate
    return None


def hub_problem(model: str) -> str | None:
    """Why the Hugging Face Hub would refuse ``model`` as a repo id (huggingface_hub's own rule), or None."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return (f"{_shown(model)} is not a name the Hugging Face Hub accepts: Org/Name, each part 1 to 96 letters, "
                "digits, '_', '-' or '.', neither starting nor ending with '-' or '.', without '--' or '..', not "
                "ending in '.git'; check the name, or pass a local directory holding its config.json")
    return None


def load(model: str, *, models_dir_: str | Path | None = None, params: int | None = None) -> ModelInfo:
    """A model by local directory, ``Org/Name`` under a models directory, or Hugging Face repo id."""
    md = models_dir(models_dir_)
    found = local_dir(model, md)
    if found is not None:
        # Org__Name under the models directory stands for the repo Org/Name; a path, for itself.
        repo = model if found != Path(model).expanduser() else None
        return load_dir(found, name=repo, source=repo, params=params)
    if not is_repo_id(model):
        raise ModelError(f"{_shown(model)} is neither a directory with a config.json nor a Hugging Face repo id "
                         "(Org/Name); check the path or the name")
    if (why := hub_problem(model)) is not None:
        raise ModelError(why)
    if (why := _missed(model)) is not None:
        raise ModelError(why)
    offline = _offline() or not hub_reachable()
    if offline:
        return _load_hub(model, md, params, offline=True)
    try:
        return _hub_pool.submit(_load_hub, model, md, params, offline=False).result(timeout=HUB_LOOKUP_S)
    except concurrent.futures.TimeoutError:
        why = (f"{model}: the Hugging Face Hub did not answer within {HUB_LOOKUP_S:g}s; fetch it once with "
               f"`hf download {model} config.json model.safetensors.index.json` (then it is read from the cache), "
               "set HF_HUB_OFFLINE=1 on an air-gapped fleet, or pass a local directory holding its config.json")
        _remember_miss(model, why)
        raise ModelError(why) from None
    except ModelError as e:
        _remember_miss(model, str(e))
        raise


def _load_hub(model: str, md: Path | None, params: int | None, *, offline: bool) -> ModelInfo:
    """A model by Hugging Face repo id: from the cache, and from the Hub when ``offline`` is False."""
    cfg = _hf_file(model, "config.json", offline)
    if cfg is None:
        where = f" under {md}" if md else ""
        raise ModelError(
            f"{model}: no config.json in the Hugging Face cache ({hf_cache_dir()}){where}"
            + (" and HF_HUB_OFFLINE=1 forbids the network" if _offline() else
               " and the Hub cannot be reached from here" if offline else " and the Hub could not be reached")
            + f"; fetch it once with `hf download {model} config.json model.safetensors.index.json`, "
            "or pass a local directory holding its config.json"
        )
    raw = _read_json(cfg)
    if not stated_quantization(raw):  # maybe an older ModelOpt checkpoint, stating it beside
        raw = with_hf_quant_config(raw, _hf_file(model, "hf_quant_config.json", offline))
    info = from_config(raw, name=model, source=model, where=f"config.json of {model}")
    if params:
        return _finish(info, params, "--params")
    index = _hf_file(model, "model.safetensors.index.json", offline)
    if index is not None:
        n = params_from_index(_read_json(index), info)
        if n:
            return _finish(info, n, "safetensors-index")
    if not offline and not info.quantization:
        n = _hub_params(model)
        if n:
            return _finish(info, n, "hf-metadata")
    single = _hf_file(model, "model.safetensors", True)
    if single is not None and not info.quantization:
        n = params_from_headers([single])
        if n:
            return _finish(info, n, "safetensors-header")
    return _finish(info, None, "")
