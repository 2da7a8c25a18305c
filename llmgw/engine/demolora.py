"""A random LoRA adapter for the demo model, written offline: a GGUF adapter for llama.cpp, or PEFT for vLLM.

Fitted to the model in a directory by its config.json (the demo model's, or any Llama-style
one's), in ``DIR/loras/``: ``NAME.gguf`` (``general.type`` adapter, ``adapter.type`` lora,
``adapter.lora.alpha``, F16 ``blk.N.<module>.weight.lora_a`` / ``.lora_b``), or a PEFT
directory ``NAME/`` (``adapter_config.json`` and bf16 ``adapter_model.safetensors``). Beside
the model, not in its directory's top level, where the planner and the engines look for the
model's own files.

Unlike a freshly initialised PEFT adapter, whose B is zero (a no-op until trained), both
factors are random, sized so that ``alpha / r x B A`` is about as large as the weight it is
added to: an answer with the adapter differs from the base's.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from llmgw import messages as m
from llmgw.engine.demomodel import (
    WEIGHT_SCALE,
    bf16_bytes,
    write_gguf_file,
    write_json,
    write_safetensors,
)
from llmgw.errors import ConfigError

LoraFormat = Literal["gguf", "hf"]
# The modules of a Llama decoder layer a LoRA may adapt, by their Hugging Face names, in the order
# PEFT writes them, with llama.cpp's names for them.
MODULES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
           "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
MAX_RANK = 512  # the largest vLLM serves
MAX_ALPHA = 4096.0
LORAS = "loras"  # the folder beside the model's files


@dataclass(frozen=True)
class DemoLora:
    """What write_demo_lora wrote."""

    format: LoraFormat
    path: Path  # the GGUF file, or the PEFT directory: what an engine and ``ctl adapter add`` are given
    name: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    layers: int
    tensor_bytes: int  # its tensors alone
    files: tuple[Path, ...]


def _shapes(cfg: dict[str, Any], where: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """The layer count and each module's (in, out), from a Llama-style config.json."""
    def need(key: str) -> int:
        value = cfg.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= 1 << 20:
            raise ConfigError(f"{where} states no {key} (a positive integer); a LoRA is fitted to a Llama-style "
                              "model's config.json, as `llmgw demo-model` writes one")
        return value

    hidden, heads, layers, ffn = need("hidden_size"), need("num_attention_heads"), need("num_hidden_layers"), \
        need("intermediate_size")
    kv_heads = need("num_key_value_heads") if "num_key_value_heads" in cfg else heads
    head_dim = need("head_dim") if "head_dim" in cfg else hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    return layers, {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                    "gate_proj": (hidden, ffn), "up_proj": (hidden, ffn), "down_proj": (ffn, hidden)}


def demo_model_format(dir: Path) -> LoraFormat | None:
    """The form of the model in ``dir``: ``hf`` (model.safetensors), ``gguf`` (a .gguf), or None."""
    if (dir / "model.safetensors").is_file() or any(dir.glob("model-*.safetensors")):
        return "hf"
    if any(dir.glob("*.gguf")):
        return "gguf"
    return None


def parse_lora_targets(text: str) -> tuple[str, ...]:
    """``q_proj,v_proj`` (or llama.cpp's ``attn_q,attn_v``, or ``all``) as Hugging Face module names, in order."""
    if text.strip().lower() == "all":
        return tuple(MODULES)
    by_gguf = {v: k for k, v in MODULES.items()}
    wanted = [w.strip() for w in text.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in MODULES and w not in by_gguf]
    if unknown or not wanted:
        raise ConfigError(f"--lora-targets {text!r}: name modules of {', '.join(MODULES)} (or all), comma-separated")
    chosen = {by_gguf.get(w, w) for w in wanted}
    return tuple(k for k in MODULES if k in chosen)


def check_demo_lora(name: str, *, rank: int, alpha: float, targets: tuple[str, ...]) -> None:
    """A ConfigError naming what is wrong with an adapter to write, before anything is written."""
    if not re.match(m.NAME_PATTERN, name) or len(name) > m.NAME_MAX:
        raise ConfigError(f"--lora {name!r}: an adapter's name is {m.NAME_RULE}")
    if not 1 <= rank <= MAX_RANK:
        raise ConfigError(f"--lora-rank {rank} is outside 1..{MAX_RANK} (the largest rank vLLM serves); pass e.g. 8")
    if not 0 < alpha <= MAX_ALPHA:  # NaN too
        raise ConfigError(f"--lora-alpha {alpha:g} is outside (0, {MAX_ALPHA:g}]; pass e.g. {2 * rank}")
    unknown = [t for t in targets if t not in MODULES]
    if unknown or not targets:
        raise ConfigError(f"LoRA targets {unknown or '(none)'}: name modules of {', '.join(MODULES)}")


def write_demo_lora(dir: Path, name: str, *, format: LoraFormat = "gguf", rank: int = 8, alpha: float = 16.0,
                    targets: tuple[str, ...] = tuple(MODULES), seed: int = 0) -> DemoLora:
    """Write a random LoRA of rank ``rank`` for the model whose config.json is in ``dir``, into ``dir/loras``."""
    check_demo_lora(name, rank=rank, alpha=alpha, targets=targets)
    config = dir / "config.json"
    try:
        cfg = json.loads(config.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{dir} holds no model (no config.json); write one first: llmgw demo-model {dir}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{config} is not a readable config.json ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{config} is not a JSON object")
    layers, shapes = _shapes(cfg, config)
    try:
        import numpy as np
    except ImportError as e:
        raise ConfigError(f"writing a LoRA needs numpy ({e}); pip install 'llmgw[demo]'") from e

    # Each factor's spread: scale x B A then has about WEIGHT_SCALE's, whatever the rank and alpha.
    sigma = math.sqrt(WEIGHT_SCALE / (alpha / rank * math.sqrt(rank)))
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])  # two names, two adapters
    # PEFT's [r, in] (lora_A) and [out, r] (lora_B); in ggml's order, ne = [in, r] and [r, out].
    pairs = [(layer, module, rng.standard_normal((rank, shapes[module][0]), dtype=np.float32) * sigma,
              rng.standard_normal((shapes[module][1], rank), dtype=np.float32) * sigma)
             for layer in range(layers) for module in targets]
    out = dir / LORAS
    out.mkdir(parents=True, exist_ok=True)
    if format == "gguf":
        path = out / f"{name}.gguf"
        _write_gguf(path, name, alpha, pairs)
        files: tuple[Path, ...] = (path,)
        tensor_bytes = sum(2 * (a.size + b.size) for _, _, a, b in pairs)  # F16
    elif format == "hf":
        path = out / name
        path.mkdir(exist_ok=True)
        weights = path / "adapter_model.safetensors"
        prefix = "base_model.model.model.layers"
        tensors: list[tuple[str, tuple[int, ...]]] = []
        data: list[Any] = []
        for layer, module, a, b in pairs:
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            tensors += [(f"{prefix}.{layer}.{block}.{module}.lora_A.weight", a.shape),
                        (f"{prefix}.{layer}.{block}.{module}.lora_B.weight", b.shape)]
            data += [a, b]
        write_safetensors(weights, tensors, (bf16_bytes(x) for x in data))
        adapter_config = write_json(path / "adapter_config.json", {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(dir.resolve()),
            "r": rank, "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha, "lora_dropout": 0.0,
            "target_modules": list(targets), "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None,
        })
        files = (adapter_config, weights)
        tensor_bytes = sum(2 * x.size for x in data)  # bf16
    else:
        raise ConfigError(f"--format {format!r} is not one of gguf, hf")
    return DemoLora(format=format, path=path, name=name, rank=rank, alpha=float(alpha), targets=targets,
                    layers=layers, tensor_bytes=tensor_bytes, files=files)


def _write_gguf(path: Path, name: str, alpha: float, pairs: Iterable[tuple[int, str, Any, Any]]) -> None:
    try:
        import gguf
        import numpy as np
    except ImportError as e:
        raise ConfigError(f"writing a GGUF adapter needs the gguf package ({e}); pip install 'llmgw[demo]'") from e
    tmp = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(tmp, "llama")  # general.architecture: llama-server refuses one of another arch
    try:
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_name(name)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        for layer, module, a, b in pairs:
            at = f"blk.{layer}.{MODULES[module]}.weight"
            w.add_tensor(f"{at}.lora_a", a.astype(np.float16))
            w.add_tensor(f"{at}.lora_b", b.astype(np.float16))
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    write_gguf_file(w, tmp, path)
