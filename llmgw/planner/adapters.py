"""LoRA adapters as their own files state them: rank, alpha, target modules, size, and the base they fit.

Two forms, never retyped by an operator:

* **PEFT** (vLLM): a directory with ``adapter_config.json`` (``r``, ``lora_alpha``,
  ``target_modules``) and ``adapter_model.safetensors``, whose header gives every
  ``…<module>.lora_A.weight`` ``[r, in]`` and ``lora_B.weight`` ``[out, r]``.
* **GGUF** (llama.cpp): one file whose ``general.type`` is ``adapter``, ``adapter.type``
  ``lora``, with ``adapter.lora.alpha`` and tensors ``blk.N.<module>.weight.lora_a`` /
  ``.lora_b``; only its header is read (bounded), never its tensors.

``check_base`` says why an adapter cannot run on a base model (architecture, layers, a
module whose shape is not the base's), from the same figures the planner sizes it with.
Every count and length is bounded where it is read: a file is outside input.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

from llmgw import messages as m
from llmgw.engine.argv import VLLM_LORA_RANKS
from llmgw.errors import ModelError

Format = Literal["peft", "gguf"]
MAX_RANK = 1024
MAX_TENSORS = 100_000
MAX_HEADER_BYTES = 64 << 20  # a safetensors header, or a GGUF's metadata: far more than any adapter's
MAX_STRING = 1 << 16

# The modules of a Llama-style decoder, by their Hugging Face names, and llama.cpp's names for them.
GGUF_NAMES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
              "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_PEFT_TENSOR = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight\Z")
_GGUF_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])\Z")
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class AdapterFacts:
    """What an adapter's files say: its form, where its weights are, and the figures it is sized by."""

    format: Format
    path: Path  # the directory (PEFT) or the file (GGUF) an engine is given
    rank: int
    alpha: float
    target_modules: tuple[str, ...]  # Hugging Face names (q_proj, …), sorted
    size_bytes: int  # its tensors' bytes
    layers: int  # one past the highest layer it adapts
    shapes: dict[str, tuple[int, int]]  # module → (in, out) it was trained for
    architecture: str = ""  # GGUF's general.architecture ("llama"); PEFT states none

    def spec(self, name: str, base: str, source: str) -> m.AdapterSpec:
        """The declaration ``ctl adapter add`` publishes."""
        return m.AdapterSpec(name=name, base=base, source=source, path=str(self.path), format=self.format,
                             rank=self.rank, alpha=self.alpha, target_modules=self.target_modules,
                             size_bytes=self.size_bytes)


def read(path: Path) -> AdapterFacts:
    """An adapter's facts from a PEFT directory or a GGUF file; ModelError saying what is wrong otherwise."""
    if path.is_dir():
        if (path / "adapter_config.json").is_file():
            return _read_peft(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _read_gguf(ggufs[0])
        raise ModelError(f"{path} holds no adapter_config.json (a PEFT adapter) and "
                         f"{'no' if not ggufs else 'more than one'} .gguf file; give the adapter's directory or file")
    if path.is_file():
        if path.name == "adapter_config.json":
            return _read_peft(path.parent)
        return _read_gguf(path)
    raise ModelError(f"{path} does not exist; give a PEFT adapter's directory or a GGUF adapter file")


def _read_peft(d: Path) -> AdapterFacts:
    try:
        cfg = json.loads((d / "adapter_config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{d / 'adapter_config.json'} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{d / 'adapter_config.json'} is not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ModelError(f"{d} is a {cfg.get('peft_type')} adapter; only LoRA adapters are served")
    weights = d / "adapter_model.safetensors"
    if not weights.is_file():
        raise ModelError(f"{d} has no adapter_model.safetensors (a .bin adapter needs converting: PEFT's "
                         "save_pretrained(safe_serialization=True) writes one)")
    header = _safetensors_header(weights)
    shapes: dict[str, tuple[int, int]] = {}
    ranks: set[int] = set()
    layers = 0
    size = 0
    for tensor, entry in header.items():
        if tensor == "__metadata__" or not isinstance(entry, dict):
            continue
        shape, dtype = entry.get("shape"), entry.get("dtype")
        if not (isinstance(shape, list) and all(isinstance(x, int) and 0 <= x < 1 << 40 for x in shape)):
            raise ModelError(f"{weights}: tensor {tensor[:200]!r} has no valid shape")
        size += math.prod(shape) * _SAFETENSORS_BYTES.get(str(dtype), 2)
        match = _PEFT_TENSOR.match(tensor)
        if match is None or len(shape) != 2:
            continue
        layer, module, part = int(match[1]), match[2], match[3]
        layers = max(layers, layer + 1)
        if part == "A":  # [r, in]
            ranks.add(shape[0])
            shapes[module] = (shape[1], shapes.get(module, (0, 0))[1])
        else:  # [out, r]
            ranks.add(shape[1])
            shapes[module] = (shapes.get(module, (0, 0))[0], shape[0])
    rank = _int(cfg.get("r"), "r", d)
    if not shapes:
        raise ModelError(f"{weights} holds no lora_A/lora_B tensors of decoder layers")
    if ranks - {rank}:
        raise ModelError(f"{d}: adapter_config.json says r = {rank}, its tensors have rank {sorted(ranks)}")
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or not 0 < alpha <= 1 << 20:
        raise ModelError(f"{d}: lora_alpha {alpha!r} is not a positive number")
    return AdapterFacts(format="peft", path=d.resolve(), rank=rank, alpha=float(alpha),
                        target_modules=tuple(sorted(shapes)), size_bytes=size, layers=layers, shapes=shapes)


def _int(value: Any, key: str, where: Path) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_RANK:
        raise ModelError(f"{where}: {key} = {value!r} is not a rank from 1 to {MAX_RANK}")
    return value


def _safetensors_header(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ModelError(f"{path} is too short to be a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES:
                raise ModelError(f"{path}: a {n}-byte safetensors header is more than an adapter has")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ModelError(f"cannot read {path}: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path} has no valid safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ModelError(f"{path} has no valid safetensors header")
    return header


# --- GGUF: the header only ------------------------------------------------------------------------------

# ggml type → (block elements, block bytes): what a tensor of n elements stores.
_GGML_BLOCKS = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24)}
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class _Reader:
    def __init__(self, f: BinaryIO, path: Path) -> None:
        self.f, self.path, self.read_bytes = f, path, 0

    def take(self, n: int) -> bytes:
        self.read_bytes += n
        if self.read_bytes > MAX_HEADER_BYTES:
            raise ModelError(f"{self.path}: its GGUF metadata runs past {MAX_HEADER_BYTES >> 20} MiB")
        raw = self.f.read(n)
        if len(raw) < n:
            raise ModelError(f"{self.path} ends inside its GGUF header (truncated?)")
        return raw

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > MAX_STRING:
            raise ModelError(f"{self.path}: a {n}-byte string in its GGUF header")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALAR:
            return self.unpack(_SCALAR[kind])
        if kind == 8:
            return self.string()
        if kind == 9:
            inner, count = self.unpack("<I"), self.unpack("<Q")
            if count > MAX_TENSORS * 16:
                raise ModelError(f"{self.path}: a GGUF array of {count} items")
            return [self.value(inner) for _ in range(count)]
        raise ModelError(f"{self.path}: GGUF value type {kind} is not one this reader knows")


def _read_gguf(path: Path) -> AdapterFacts:
    try:
        with path.open("rb") as f:
            r = _Reader(f, path)
            if f.read(4) != b"GGUF":
                raise ModelError(f"{path} is not a GGUF file (no GGUF magic) nor a PEFT adapter directory")
            version = r.unpack("<I")
            if version not in (2, 3):
                raise ModelError(f"{path}: GGUF version {version}; llama.cpp writes versions 2 and 3")
            n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
            if n_tensors > MAX_TENSORS or n_kv > MAX_TENSORS:
                raise ModelError(f"{path}: {n_tensors} tensors and {n_kv} keys is more than an adapter has")
            kv = {}
            for _ in range(n_kv):
                key = r.string()
                kv[key] = r.value(r.unpack("<I"))
            tensors = []
            for _ in range(n_tensors):
                name = r.string()
                dims = r.unpack("<I")
                if dims > 4:
                    raise ModelError(f"{path}: tensor {name[:200]!r} has {dims} dimensions")
                ne = [r.unpack("<Q") for _ in range(dims)]
                kind = r.unpack("<I")
                r.unpack("<Q")  # offset
                tensors.append((name, ne, kind))
    except OSError as e:
        raise ModelError(f"cannot read {path}: {e.strerror}") from None
    if kv.get("general.type") != "adapter" or str(kv.get("adapter.type", "")).lower() != "lora":
        raise ModelError(f"{path} is a GGUF {kv.get('general.type', 'model')!s}, not a LoRA adapter "
                         "(general.type = adapter, adapter.type = lora: llama.cpp's convert_lora_to_gguf.py writes one)")
    shapes: dict[str, tuple[int, int]] = {}
    ranks: set[int] = set()
    layers = 0
    size = 0
    for name, ne, kind in tensors:
        elements, block = _GGML_BLOCKS.get(kind, (1, 2))
        size += math.prod(ne) // elements * block
        match = _GGUF_TENSOR.match(name)
        if match is None or len(ne) != 2:
            continue
        layer, module = int(match[1]), GGUF_NAMES.get(match[2], match[2])
        layers = max(layers, layer + 1)
        if match[3] == "a":  # ggml ne [in, r]
            ranks.add(ne[1])
            shapes[module] = (ne[0], shapes.get(module, (0, 0))[1])
        else:  # ne [r, out]
            ranks.add(ne[0])
            shapes[module] = (shapes.get(module, (0, 0))[0], ne[1])
    if not shapes:
        raise ModelError(f"{path} holds no blk.N.*.weight.lora_a/lora_b tensors")
    if len(ranks) != 1 or not 1 <= min(ranks) <= MAX_RANK:
        raise ModelError(f"{path}: its tensors have ranks {sorted(ranks)}; one rank from 1 to {MAX_RANK} is served")
    (rank,) = ranks
    alpha = kv.get("adapter.lora.alpha", rank)
    if not isinstance(alpha, int | float) or not 0 < alpha <= 1 << 20:
        raise ModelError(f"{path}: adapter.lora.alpha {alpha!r} is not a positive number")
    return AdapterFacts(format="gguf", path=path.resolve(), rank=rank, alpha=float(alpha),
                        target_modules=tuple(sorted(shapes)), size_bytes=size, layers=layers, shapes=shapes,
                        architecture=str(kv.get("general.architecture", "")))


# --- does it fit its base -------------------------------------------------------------------------------


def base_shapes(info: m.ModelInfo) -> dict[str, tuple[int, int]]:
    """(in, out) of each adaptable module of a dense decoder layer of ``info``."""
    q = info.num_attention_heads * info.head_dim
    kv = info.num_kv_heads * info.head_dim
    out = {"q_proj": (info.hidden_size, q * (2 if info.attn_output_gate else 1)), "k_proj": (info.hidden_size, kv),
           "v_proj": (info.hidden_size, kv), "o_proj": (q, info.hidden_size)}
    if not info.num_experts:
        out |= {"gate_proj": (info.hidden_size, info.intermediate_size),
                "up_proj": (info.hidden_size, info.intermediate_size),
                "down_proj": (info.intermediate_size, info.hidden_size)}
    return out


def check_base(facts: AdapterFacts, info: m.ModelInfo) -> str | None:
    """Why the adapter cannot run on ``info``'s model, or None when every figure it states matches."""
    arch = info.model_type or info.architecture
    if facts.architecture and arch and facts.architecture.lower() not in (arch.lower(), info.architecture.lower()):
        return f"it is a LoRA for a {facts.architecture} model; {info.name} is a {arch}"
    if facts.layers > info.num_layers:
        return f"it adapts {facts.layers} layers; {info.name} has {info.num_layers}"
    known = base_shapes(info)
    for module, (a, b) in sorted(facts.shapes.items()):
        want = known.get(module)
        if want is not None and (a, b) != want:
            return (f"its {module} is {a} → {b} wide; {info.name}'s is {want[0]} → {want[1]} "
                    f"(hidden size {info.hidden_size}): an adapter of another model")
    return None


# --- what they take on a GPU ----------------------------------------------------------------------------

VLLM_RANKS = VLLM_LORA_RANKS  # what vLLM's --max-lora-rank accepts: the engine command's one table
LORA_DTYPE_BYTES = 2  # vLLM's --lora-dtype auto: the model's 16-bit type


def vllm_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``--max-lora-rank`` that holds ``rank`` (0: LoRA off)."""
    if rank <= 0:
        return 0
    for allowed in VLLM_RANKS:
        if allowed >= rank:
            return allowed
    raise ModelError(f"rank {rank} is above the {VLLM_RANKS[-1]} vLLM serves")


def lora_bytes_per_gpu(info: m.ModelInfo, engine: str, tp: int, pp: int = 1, *, max_loras: int = 0,
                       max_rank: int = 0, adapter_bytes: int = 0) -> float:
    """GPU memory one rank of a replica gives its LoRA adapters.

    vLLM: stacked ``lora_a``/``lora_b`` buffers for ``max_loras`` slots of ``max_rank``, on every
    layer it can adapt, whatever an adapter targets (q/k/v, o, gate/up, down; the column-parallel
    widths split by tp), and on the embeddings and lm_head: max_loras x rank x 2 bytes x
    (layers x (7H + 2 q/tp + 2 kv/tp + 3 I/tp) + 2V + 2H), which the research against vLLM 0.32's
    buffers matched to the byte. They are allocated with the weights, before the KV cache is sized.
    llama.cpp: the attached adapters' own tensors, spread over its layer split.
    """
    if engine == "llama.cpp":
        return adapter_bytes / max(1, tp * pp)
    if max_loras <= 0 or max_rank <= 0:
        return 0.0
    h, i = info.hidden_size, info.intermediate_size or 4 * info.hidden_size
    q, kv = info.num_attention_heads * info.head_dim, info.num_kv_heads * info.head_dim
    per_layer = 7 * h + (2 * q + 2 * kv + 3 * i) / tp
    layers = math.ceil(info.num_layers / max(1, pp))
    return float(max_loras * vllm_rank(max_rank) * LORA_DTYPE_BYTES * (layers * per_layer + 2 * info.vocab_size + 2 * h))
