"""The memory model: bytes per GPU for weights, overhead and KV cache of one split. Pure: no I/O, no clock.

The memory model, per GPU, for one replica split ``tp`` ways inside a node and
``pp`` ways across nodes (llama.cpp: ``tp`` counts the GPUs its layer split
spreads over, on one node):

* **Budget** = ``gpu_memory_utilization`` x the card's *total* memory. vLLM
  sizes everything from that fraction; the rest of the card is the slack, and
  it is reserved exactly once, here. llama.cpp has no such flag; the planner
  holds it to the same fraction so that both engines leave the same slack.
* **Weights per GPU** = the rank's share, tensor by tensor, at the precision's
  real size. vLLM: matmuls, embeddings and lm_head are split by tp (K/V
  projections only down to one KV head per rank, then replicated; MLA's
  low-rank down-projections and MoE routers are replicated), layers by pp;
  the worst stage is charged. fp8 and AWQ/GPTQ (4 bits + a 16-bit scale and a
  4-bit zero per group of 128) apply to matmuls only; embeddings, lm_head, norms
  and routers stay 16-bit. mxfp4 (gpt-oss's own checkpoints): the routed experts
  as vLLM re-lays them for its kernels, fp4 with an e8m0 scale per 32 weights and
  16-bit biases, the hidden size padded to 256 and each rank's intermediate size
  to 128 (256 on Blackwell); attention, routers, embeddings and lm_head stay
  16-bit. GGUF: llama.cpp's own tensor-type rules (below), with token embeddings
  left in host memory unless they double as the output.
  The tensor breakdown comes from the architecture and is scaled to the
  parameter count read from the checkpoint, so both always agree on the total.
* **Overhead per GPU**, from that rank's share, as the engine version's profile counts it
  when it sizes the KV cache (``llmgw.engine.profiles``; fitted per version range on published
  start-up logs: ``tests/data/vllm_observed.jsonl``, figures in docs/benchmarks.md):
  - the activation peak of its profiling run, the larger of the forward pass
    (``max_num_batched_tokens`` x 2 bytes x (the rank's q/k/v width + 4 x hidden +
    3 x the rank's MLP width, top-k experts for MoE)) and the sampler's dummy pass
    (``max_num_seqs`` x vocab x fp32, the profile's copies over; not split by tp).
    ``max_num_seqs`` is what the plan passes (``--max-num-seqs``), by default the
    version's default on that card.
  - memory outside torch's allocator that it counts, plus NCCL and custom all-reduce
    buffers when tp x pp > 1.
  - CUDA graphs (``cuda_graph_bytes_per_gpu``): from vLLM 0.20 profiled and taken from the
    budget; before, captured after the cache is sized, out of the slack, which must then
    hold them beside the CUDA context (~0.5 GiB), from 0.10 with the profiling run's activation
    free again (``capture_headroom``). The planner (``llmgw.planner``) charges
    them or proposes ``--enforce-eager`` where the slack cannot.
  llama.cpp: a CUDA context of 0.5 GiB and its compute buffer with its
  ``n_ubatch`` of 512 tokens in fp32.
* **KV cache** = budget - weights - overhead. Per token per GPU: layers x 2 x
  max(1, kv_heads / tp) x head_dim x 2 bytes (16-bit cache). MLA caches one
  latent of kv_lora_rank + qk_rope_head_dim per layer, replicated on every tp
  rank. Sliding-window layers hold at most their window plus the batch in
  flight (vLLM's hybrid allocator; llama.cpp's SWA cache). Gemma 4's full-attention
  layers have their own head size and KV heads, and its KV-sharing layers hold none;
  a hybrid model's linear-attention layers hold a fixed state per sequence instead. The tokens
  vLLM prints for its cache are another unit for a hybrid (``engine_kv_tokens``): before 0.20 its
  hybrid allocator gives every layer group pages of one size, so one token of its count costs the
  attention and linear layers' pages (Qwen3.5-27B: 64 layers' worth, where 16 keep KV).

A candidate fits when weights + overhead leave room for the context asked for
(default: the model's full context, else the largest that fits, at least 2048
tokens): vLLM refuses to start when one sequence of ``max_model_len`` does not
fit in the KV cache.

Over 600 lines: the whole memory model, weights, overhead and KV of every architecture,
reads in one place, so that a reader checking a figure against an engine's log finds
every term of it here.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from llmgw import messages as m
from llmgw.engine.profiles import NEWEST, EngineProfile
from llmgw.errors import PlanError

GIB = 1024**3
MIB = 1024**2

# --- constants of the memory model (see the module docstring for their sources) ---
VLLM_BATCHED_TOKENS = 8192  # the KV window's tokens in flight (sliding layers), as on a large card
LLAMACPP_UBATCH = 512
# CUDA graphs, per rank (fitted on the logs' "Graph capturing finished … took X GiB" and "Estimated
# CUDA graph memory"): a base, each captured layer's output buffers at the largest capture size
# (min(512, 2 x max_num_seqs) tokens x hidden x 2 B), the fused-MoE workspaces of each MoE layer
# (0.03 GiB at that largest size of 512, in proportion below it: Qwen3-235B-A22B at tp 4 with 32
# sequences captured 0.32 GiB in all, where a fixed 0.03 a layer said 3.2), and the custom
# all-reduce's registered buffers when the replica is split.
GRAPH_BASE_BYTES = int(0.1 * 1024**3)
GRAPH_CAPTURE_MAX = 512
GRAPH_BYTES_PER_ELEMENT = 2
GRAPH_MOE_LAYER_BYTES = int(0.03 * 1024**3)
GRAPH_ALLREDUCE_BYTES = int(0.25 * 1024**3)
CUDA_CONTEXT_BYTES = GIB // 2
KV_DTYPE_BYTES = 2
MIN_CONTEXT = 2048
# Without --context every candidate is judged at the model's full context, capped here:
# a 128k window is rarely what a replica is sized for, and 2k is no recommendation.
DEFAULT_CONTEXT_CAP = 32_768
VLLM_BLOCK = 16
LLAMACPP_CTX_PAD = 256
DEFAULT_TPS = (1, 2, 4, 8)
MAX_PP = 8
INT4_BPW = 4 + (16 + 4) / 128  # AWQ/GPTQ: 4-bit weights, fp16 scale and 4-bit zero per group of 128


@dataclass(frozen=True)
class Precision:
    """A precision as its engine spells it; choosing it chooses the engine."""

    name: str
    engine: m.Engine
    kind: str  # 16bit | fp8 | int4 | ckpt (only a checkpoint already so) | gguf
    ggml: str = ""  # GGUF: the base block type of the file


PRECISIONS: tuple[Precision, ...] = (
    Precision("bf16", "vllm", "16bit"),
    Precision("fp16", "vllm", "16bit"),
    Precision("fp8", "vllm", "fp8"),
    Precision("int8", "vllm", "ckpt"),
    Precision("bnb-8bit", "vllm", "ckpt"),
    Precision("awq", "vllm", "int4"),
    Precision("gptq", "vllm", "int4"),
    Precision("int4", "vllm", "ckpt"),
    Precision("fp4", "vllm", "ckpt"),
    Precision("mxfp4", "vllm", "ckpt"),
    Precision("bnb-4bit", "vllm", "ckpt"),
    Precision("q8_0", "llama.cpp", "gguf", "Q8_0"),
    Precision("q6_K", "llama.cpp", "gguf", "Q6_K"),
    Precision("q5_K_M", "llama.cpp", "gguf", "Q5_K"),
    Precision("q4_K_M", "llama.cpp", "gguf", "Q4_K"),
)
BY_NAME = {p.name.lower(): p for p in PRECISIONS}
RANK = {p.name: i for i, p in enumerate(PRECISIONS)}
GGUF_NAMES = tuple(p.name for p in PRECISIONS if p.kind == "gguf")

# ggml block formats: bits per weight (block bytes x 8 / block elements).
GGML_BPW = {"F32": 32.0, "F16": 16.0, "Q8_0": 8.5, "Q6_K": 6.5625, "Q5_K": 5.5, "Q4_K": 4.5,
            "Q5_0": 5.5, "Q5_1": 6.0}
# A K-quant needs rows that are a multiple of 256; llama.cpp falls back to these.
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def precision(name: str) -> Precision:
    """A precision by name, case-insensitively."""
    p = BY_NAME.get(name.lower())
    if p is None:
        raise PlanError(f"unknown precision {name!r}; known: {', '.join(BY_NAME[k].name for k in BY_NAME)}")
    return p


# --- the model's tensors ----------------------------------------------------------------


class Tensor(NamedTuple):
    """One weight tensor (or all experts of one kind in a layer) as llama.cpp names it."""

    name: str  # token_embd, output, attn_q, attn_k, attn_v, attn_output, ffn_gate, ..., norm
    layer: int  # -1 outside the layers
    params: int
    row: int  # the input width (ggml ne0): decides K-quant fallbacks
    matmul: bool  # a linear layer's weight: what fp8/AWQ/GPTQ quantize
    split: str  # tp: sharded by tp | kv: sharded by KV heads | rep: replicated on every rank


def _layer_tensors(info: m.ModelInfo, i: int) -> list[Tensor]:
    h, heads, kv, hd = info.hidden_size, info.num_attention_heads, info.num_kv_heads, info.head_dim
    norms = 4 if info.model_type.startswith("gemma") else 2
    out = [Tensor("norm", i, norms * h, h, False, "rep")]
    if i in _linear_set(info):
        # Gated delta-net: q, k (key heads) and v, z (value heads) in, a beta and an alpha per value head,
        # a short causal convolution over q, k, v, the decay and dt per head, a gated norm, out.
        kd = info.linear_qk_heads * info.linear_qk_head_dim
        vd = info.linear_value_heads * info.linear_value_head_dim
        out += [Tensor("ssm_in", i, h * (2 * kd + 2 * vd), h, True, "tp"),
                Tensor("ssm_ba", i, h * 2 * info.linear_value_heads, h, True, "tp"),
                Tensor("ssm_conv1d", i, (2 * kd + vd) * info.linear_conv_kernel, info.linear_conv_kernel, False, "tp"),
                Tensor("ssm_a", i, 2 * info.linear_value_heads, 1, False, "tp"),
                Tensor("ssm_norm", i, info.linear_value_head_dim, info.linear_value_head_dim, False, "rep"),
                Tensor("ssm_out", i, vd * h, vd, True, "tp")]
    elif info.kv_lora_rank:
        qk = info.qk_nope_head_dim + info.qk_rope_head_dim
        if info.q_lora_rank:
            out += [Tensor("attn_q_a", i, h * info.q_lora_rank, h, True, "rep"),
                    Tensor("norm", i, info.q_lora_rank, info.q_lora_rank, False, "rep"),
                    Tensor("attn_q_b", i, info.q_lora_rank * heads * qk, info.q_lora_rank, True, "tp")]
        else:
            out.append(Tensor("attn_q", i, h * heads * qk, h, True, "tp"))
        out += [Tensor("attn_kv_a_mqa", i, h * (info.kv_lora_rank + info.qk_rope_head_dim), h, True, "rep"),
                Tensor("norm", i, info.kv_lora_rank, info.kv_lora_rank, False, "rep"),
                Tensor("attn_kv_b", i, info.kv_lora_rank * heads * (info.qk_nope_head_dim + info.v_head_dim),
                       info.kv_lora_rank, True, "tp"),
                Tensor("attn_output", i, heads * info.v_head_dim * h, heads * info.v_head_dim, True, "tp")]
    else:
        gate = 2 if info.attn_output_gate else 1  # the output gate comes out of q_proj
        hd, kv = attention_shape(info, i)
        out += [Tensor("attn_q", i, h * heads * hd * gate, h, True, "tp"),
                Tensor("attn_k", i, h * kv * hd, h, True, "kv"),
                Tensor("attn_v", i, h * kv * hd, h, True, "kv"),
                Tensor("attn_output", i, heads * hd * h, heads * hd, True, "tp")]
        if info.attention_bias:
            out.append(Tensor("bias", i, (heads + 2 * kv) * hd, 1, False, "tp"))
        if info.model_type == "gpt_oss":  # o_proj's bias (on every rank) and one attention sink per head
            out += [Tensor("bias", i, h, 1, False, "rep"), Tensor("sinks", i, heads, 1, False, "tp")]
        if info.model_type.startswith("qwen3"):  # q_norm, k_norm
            out.append(Tensor("norm", i, 2 * hd, hd, False, "rep"))
    moe = bool(info.num_experts) and i >= info.first_dense_layers
    if moe:
        e, mi = info.num_experts, info.moe_intermediate_size
        out += [Tensor("ffn_gate_inp", i, h * e, h, False, "rep"),
                Tensor("ffn_gate_exps", i, e * h * mi, h, True, "tp"),
                Tensor("ffn_up_exps", i, e * h * mi, h, True, "tp"),
                Tensor("ffn_down_exps", i, e * mi * h, mi, True, "tp")]
        if info.model_type == "gpt_oss":  # the router's and the experts' biases
            out += [Tensor("bias", i, e, 1, False, "rep"), Tensor("ffn_exps_bias", i, e * (2 * mi + h), 1, False, "tp")]
        if info.shared_experts:
            si = info.shared_experts * mi
            out += [Tensor("ffn_gate_shexp", i, h * si, h, True, "tp"),
                    Tensor("ffn_up_shexp", i, h * si, h, True, "tp"),
                    Tensor("ffn_down_shexp", i, si * h, si, True, "tp")]
    if not moe or info.dense_and_moe:  # Gemma 4's MoE layers run a dense MLP beside the experts
        f = info.intermediate_size * (2 if info.double_wide_shared and i >= info.num_layers - info.kv_shared_layers else 1)
        out += [Tensor("ffn_gate", i, h * f, h, True, "tp"),
                Tensor("ffn_up", i, h * f, h, True, "tp"),
                Tensor("ffn_down", i, f * h, f, True, "tp")]
    if info.per_layer_input_size:  # PLE: a gate from the hidden state and a projection back, per layer
        ple = info.per_layer_input_size
        out.append(Tensor("per_layer_proj", i, 2 * h * ple, h, True, "rep"))
    return out


def attention_shape(info: m.ModelInfo, i: int) -> tuple[int, int]:
    """Layer ``i``'s head size and KV heads: a full-attention layer's may differ from a sliding one's (Gemma 4)."""
    if (info.full_head_dim or info.full_kv_heads) and i not in _sliding_set(info):
        return info.full_head_dim or info.head_dim, info.full_kv_heads or info.num_kv_heads
    return info.head_dim, info.num_kv_heads


@lru_cache(maxsize=256)
def _linear_set(info: m.ModelInfo) -> frozenset[int]:
    return frozenset(info.linear_layers)


@lru_cache(maxsize=256)
def _sliding_set(info: m.ModelInfo) -> frozenset[int]:
    return frozenset(info.sliding_layers) if info.sliding_window else frozenset()


@lru_cache(maxsize=64)
def tensors(info: m.ModelInfo) -> tuple[Tensor, ...]:
    """Every weight of the model, from its architecture alone (a vision tower as one tensor: 16-bit, as
    quantized checkpoints leave it)."""
    h, v = info.hidden_size, info.vocab_size
    out = [Tensor("token_embd", -1, v * h, h, False, "tp")]
    if info.per_layer_input_size:  # PLE: a token embedding per layer, and the model's projection into them
        width = info.num_layers * info.per_layer_input_size
        out += [Tensor("per_layer_embd", -1, info.per_layer_vocab * width, info.per_layer_input_size, False, "tp"),
                Tensor("per_layer_model_proj", -1, h * width, h, True, "tp")]
    if info.vision_params:
        out.append(Tensor("vision", -1, info.vision_params, h, False, "tp"))
    for i in range(info.num_layers):
        out += _layer_tensors(info, i)
    out.append(Tensor("output_norm", -1, h, h, False, "rep"))
    if not info.tie_word_embeddings:
        out.append(Tensor("output", -1, v * h, h, False, "tp"))
    return tuple(out)


def architecture_params(info: m.ModelInfo) -> int:
    """The parameter count the architecture implies (the fallback when no checkpoint says)."""
    return sum(t.params for t in tensors(info))


# --- bytes per tensor at a precision ---------------------------------------------------------


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of layers that get more bits in the _M K-quant mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def gguf_type(p: Precision, t: Tensor, info: m.ModelInfo) -> str:
    """The ggml type llama-quantize gives a tensor (llama_tensor_get_type, for the mixes offered)."""
    if not t.matmul and t.name not in ("token_embd", "output"):
        return "F32"  # norms, biases and MoE routers stay in f32
    base = p.ggml
    qt = base
    is_output = t.name == "output" or (t.name == "token_embd" and info.tie_word_embeddings)
    mixed = p.name in ("q4_K_M", "q5_K_M")
    if is_output:
        qt = base if base == "Q8_0" else "Q6_K"
    elif t.name == "attn_v":
        if info.num_experts == 8:
            qt = "Q8_0"
        elif mixed and _use_more_bits(t.layer, info.num_layers):
            qt = "Q6_K"
    elif t.name == "attn_k" and info.num_experts == 8:
        qt = "Q8_0"
    elif t.name in ("ffn_down", "ffn_down_exps") and mixed and _use_more_bits(t.layer, info.num_layers):
        qt = "Q6_K"
    elif t.name == "attn_output" and info.num_experts == 8 and p.name == "q4_K_M":
        qt = "Q5_K"
    if qt in K_FALLBACK and t.row % 256:
        qt = K_FALLBACK[qt]
    if qt != "F32" and t.row % 32:
        qt = "F16"
    return qt


# Hugging Face module names of the tensors above, as a checkpoint's ``ignore`` list names them.
_HF_NAMES = {
    "attn_q": ("self_attn.q_proj",), "attn_k": ("self_attn.k_proj",), "attn_v": ("self_attn.v_proj",),
    "attn_output": ("self_attn.o_proj",), "attn_q_a": ("self_attn.q_a_proj",), "attn_q_b": ("self_attn.q_b_proj",),
    "attn_kv_a_mqa": ("self_attn.kv_a_proj_with_mqa",), "attn_kv_b": ("self_attn.kv_b_proj",),
    "ffn_gate": ("mlp.gate_proj",), "ffn_up": ("mlp.up_proj",), "ffn_down": ("mlp.down_proj",),
    "ffn_gate_exps": ("mlp.experts.0.gate_proj", "block_sparse_moe.experts.0.w1"),
    "ffn_up_exps": ("mlp.experts.0.up_proj", "block_sparse_moe.experts.0.w3"),
    "ffn_down_exps": ("mlp.experts.0.down_proj", "block_sparse_moe.experts.0.w2"),
    "ffn_gate_shexp": ("mlp.shared_experts.gate_proj",), "ffn_up_shexp": ("mlp.shared_experts.up_proj",),
    "ffn_down_shexp": ("mlp.shared_experts.down_proj",),
}


def _matches(pattern: str, name: str) -> bool:
    """compressed-tensors' rule (``re:`` a regular expression, else the exact name), a name's suffix,
    and the ``*`` globs of ``modules_to_not_convert`` (a glob names a module and all inside it)."""
    if "*" in pattern and not pattern.startswith("re:"):
        return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*")
    if pattern.startswith("re:"):
        try:
            return re.match(pattern[3:], name) is not None
        except re.error:
            return False
    return name == pattern or name.endswith("." + pattern)


@lru_cache(maxsize=64)
def ignored(info: m.ModelInfo) -> frozenset[tuple[str, int]]:
    """(tensor, layer) pairs a pre-quantized checkpoint keeps in 16 bits (its ``ignore`` list)."""
    if not info.quant_ignore:
        return frozenset()
    out = set()
    for t in tensors(info):
        for hf in _HF_NAMES.get(t.name, ()):
            # A multimodal wrapper's checkpoint names its language model's layers one level deeper.
            names = (f"model.layers.{t.layer}.{hf}", f"model.language_model.layers.{t.layer}.{hf}",
                     f"language_model.model.layers.{t.layer}.{hf}")
            if any(_matches(p, full) for p in info.quant_ignore for full in names):
                out.add((t.name, t.layer))
    return frozenset(out)


def tensor_bits(p: Precision, t: Tensor, info: m.ModelInfo) -> float:
    """Bits one tensor takes at a precision."""
    if p.kind == "gguf":
        return t.params * GGML_BPW[gguf_type(p, t, info)]
    if info.quantization == p.name and info.quant_bits:
        # The checkpoint's own format: its quantized matmuls at its bits, what it ignores at 16.
        if t.matmul and (t.name, t.layer) not in ignored(info):
            return t.params * info.quant_bits
        return t.params * 16.0
    if t.matmul and p.kind == "fp8":
        return t.params * 8.0
    if t.matmul and p.kind == "int4":
        return t.params * INT4_BPW
    return t.params * 16.0


_EXPERTS = frozenset({"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_exps_bias"})
# vLLM pads mxfp4 experts for its kernels (mxfp4.py, create_weights): Marlin (Ampere, Ada; the widest
# padding outside Blackwell) rounds the hidden size up to 256 and each rank's intermediate to 128;
# FlashInfer on Blackwell (B200, GB200, B300) and AITER on MI350/MI355 round both to 256. On Hopper
# from 0.11 (the profile's ``mxfp4_hopper_triton``) the OAI Triton kernels hold them: the hidden size
# to 256, each rank's intermediate only to 64 (gpt-oss-120b on one H100: 64.38 GiB printed under 0.11.0
# and 0.14.1, Marlin's padding says 65.90; at tp 2 on H200s under 0.15.1 32.98, Marlin's 34.32).
MXFP4_ALIGN = (256, 128)  # hidden, intermediate per rank
MXFP4_WIDE_ALIGN = (256, 256)
MXFP4_HOPPER_ALIGN = (256, 64)
_MXFP4_WIDE = re.compile(r"^(g?b[1-3]00|mi35\d)", re.IGNORECASE)
_HOPPER = re.compile(r"^(gh200|h100|h200|h800|h20)", re.IGNORECASE)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def mxfp4_expert_bytes(info: m.ModelInfo, tp: int, gpu_class: str = "", hopper_triton: bool = True) -> float:
    """One MoE layer's routed experts on one rank as vLLM holds an mxfp4 checkpoint's: padded
    fp4 weights, an e8m0 scale per 32 of them, and 16-bit biases (``hopper_triton``: the version
    runs the Triton kernels on Hopper)."""
    if _MXFP4_WIDE.match(gpu_class):
        h_align, i_align = MXFP4_WIDE_ALIGN
    elif hopper_triton and _HOPPER.match(gpu_class):
        h_align, i_align = MXFP4_HOPPER_ALIGN
    else:
        h_align, i_align = MXFP4_ALIGN
    h = _round_up(info.hidden_size, h_align)
    i = _round_up(-(-info.moe_intermediate_size // tp), i_align)
    fp4 = info.num_experts * 3 * i * h / 2  # gate and up (2i x h) and down (h x i), two weights a byte
    biases = info.num_experts * (2 * i + h) * 2 if info.model_type == "gpt_oss" else 0
    return fp4 * (1 + 1 / 16) + biases


class _Layout(NamedTuple):
    """A model's bytes at one precision, grouped the way ranks share them."""

    layer_tp: tuple[float, ...]  # per layer: bytes split by tp
    layer_kv: tuple[float, ...]  # per layer: K/V projection bytes, split by KV heads
    layer_rep: tuple[float, ...]  # per layer: bytes every rank holds
    layer_moe: tuple[float, ...]  # per layer: the routed experts' bytes (also in layer_tp)
    embd: float
    output: float  # 0 when tied to the embeddings
    output_norm: float
    vision: float  # the vision tower: vLLM loads it (split by tp, on the first stage); a GGUF leaves it out
    total: float  # the whole checkpoint (GGUF: the file)


@lru_cache(maxsize=256)
def layout(info: m.ModelInfo, p: Precision) -> _Layout:
    """Bytes per group at a precision, scaled so that parameters add up to ``info.params``."""
    ts = tensors(info)
    arch = sum(t.params for t in ts)
    scale = info.params / arch if info.params and arch else 1.0
    n = info.num_layers
    tp_b, kv_b, rep_b, moe_b = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    embd = output = output_norm = vision = 0.0
    for t in ts:
        b = tensor_bits(p, t, info) / 8 * scale
        if t.layer >= 0:
            (tp_b if t.split == "tp" else kv_b if t.split == "kv" else rep_b)[t.layer] += b
            if t.name in _EXPERTS:
                moe_b[t.layer] += b
        elif t.name in ("token_embd", "per_layer_embd", "per_layer_model_proj"):
            embd += b  # on the first stage, split by tp
        elif t.name == "output":
            output = b
        elif t.name == "vision":
            vision = 0.0 if p.kind == "gguf" else b  # llama.cpp reads it from a separate mmproj file
        else:
            output_norm = b
    total = sum(tp_b) + sum(kv_b) + sum(rep_b) + embd + output + output_norm + vision
    return _Layout(tuple(tp_b), tuple(kv_b), tuple(rep_b), tuple(moe_b), embd, output, output_norm, vision, total)


def stages(num_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges per pipeline stage; earlier stages take the remainder."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def kv_heads_per_rank(info: m.ModelInfo, tp: int) -> int:
    return max(1, info.num_kv_heads // tp)


def weight_bytes_per_gpu(info: m.ModelInfo, p: Precision, tp: int, pp: int = 1, gpu_class: str = "",
                         profile: EngineProfile = NEWEST) -> float:
    """The worst rank's share of the weights (``gpu_class`` and the version's ``profile`` decide vLLM's padding
    of mxfp4 experts)."""
    lay = layout(info, p)
    if p.engine == "llama.cpp":
        # Layer split over tp GPUs; token embeddings stay in host memory unless they are the output too.
        head = lay.output + lay.output_norm if not info.tie_word_embeddings else lay.embd + lay.output_norm
        per = [sum(lay.layer_tp[i] + lay.layer_kv[i] + lay.layer_rep[i] for i in r) for r in stages(info.num_layers, tp)]
        per[-1] += head
        return max(per)
    kv_share = kv_heads_per_rank(info, tp) / max(1, info.num_kv_heads)
    # mxfp4: vLLM re-lays the checkpoint's experts out for its kernels, padded (see mxfp4_expert_bytes).
    mx = mxfp4_expert_bytes(info, tp, gpu_class, profile.mxfp4_hopper_triton) if p.name == "mxfp4" and info.num_experts else 0.0
    worst = 0.0
    parts = stages(info.num_layers, pp)
    for s, r in enumerate(parts):
        b = sum(lay.layer_tp[i] / tp + lay.layer_kv[i] * kv_share + lay.layer_rep[i]
                + (mx - lay.layer_moe[i] / tp if mx and lay.layer_moe[i] else 0.0) for i in r)
        if s == 0:
            b += (lay.embd + lay.vision) / tp
        if s == len(parts) - 1:
            # A tied lm_head shares the embedding, unless it lives on another stage.
            b += lay.output_norm + (lay.output if lay.output or pp == 1 else lay.embd) / tp
        worst = max(worst, b)
    return worst


# --- KV cache -----------------------------------------------------------------------------------


class KvShape(NamedTuple):
    """What one token costs in one GPU's KV cache."""

    per_layer: int  # bytes per token per layer on this GPU
    full_layers: int  # layers on this GPU that keep every token
    window_layers: int  # layers on this GPU that keep at most window + batch tokens
    window: int  # window + tokens in flight; 0 when no layer slides
    state: int = 0  # bytes per sequence its linear-attention layers on this GPU hold, whatever its length
    window_per_layer: int = 0  # bytes per token per windowed layer when they differ from the others' (Gemma 4)
    group_layers: int = 0  # vLLM's hybrid allocator: the layers one token of its count pays a page in (0: uniform)

    @property
    def uniform(self) -> bool:
        """Every layer keeps every token alike: vLLM's count of KV tokens is then this shape's tokens. (With
        sliding or linear-attention layers its hybrid allocator counts blocks of one layer group instead.)"""
        return not self.window_layers and not self.state

    @property
    def engine_token_bytes(self) -> int:
        """What one token of vLLM's own count ("GPU KV cache size: N tokens") stands for. Its hybrid allocator
        gives every layer group (attention, sliding, linear; as many layers each) pages of one size, and a linear
        layer's state a page as large as an attention layer's: N = the cache / (groups x layers a group x an
        attention layer's bytes a token), so a hybrid's token costs its attention and linear layers' worth."""
        return self.per_layer * self.group_layers if self.group_layers else self.bytes_per_token

    @property
    def _window_bytes(self) -> int:
        return self.window_per_layer or self.per_layer

    @property
    def bytes_per_token(self) -> int:
        return self.per_layer * self.full_layers + self._window_bytes * self.window_layers

    def bytes_for(self, context: int) -> int:
        """KV bytes one sequence of ``context`` tokens holds on this GPU."""
        return (self.state + self.per_layer * self.full_layers * context
                + self._window_bytes * self.window_layers * min(context, self.window))

    def max_context(self, budget: float) -> int:
        """The longest sequence whose KV fits in ``budget`` bytes (may exceed any real limit)."""
        budget -= self.state
        if budget <= 0 or self.bytes_per_token == 0:
            return 0
        c1 = int(budget // self.bytes_per_token)
        if not self.window_layers or c1 <= self.window:
            return c1
        if not self.full_layers:
            return 1 << 40  # only windowed layers: no length limit from memory
        return int((budget - self._window_bytes * self.window_layers * self.window) // (self.per_layer * self.full_layers))


def kv_shape(info: m.ModelInfo, engine: m.Engine, tp: int, pp: int = 1, kv_bytes: int = KV_DTYPE_BYTES) -> KvShape:
    """KV per token per GPU for a split; the worst stage is charged. ``kv_bytes``: 1 for an fp8 cache."""
    if engine == "llama.cpp":
        layers = stages(info.num_layers, tp)[0]
        heads = info.num_kv_heads
        batch = LLAMACPP_UBATCH
    else:
        layers = stages(info.num_layers, pp)[0]
        heads = kv_heads_per_rank(info, tp)
        batch = VLLM_BATCHED_TOKENS
    # The last kv_shared_layers reuse an earlier layer's cache (Gemma 4): they hold none of their own.
    layers = range(layers.start, min(layers.stop, info.num_layers - info.kv_shared_layers))
    per_window = 0
    if info.kv_lora_rank:
        per_layer = (info.kv_lora_rank + info.qk_rope_head_dim) * kv_bytes  # replicated, not split
    else:
        per_layer = 2 * heads * info.head_dim * kv_bytes
        if info.full_head_dim or info.full_kv_heads:  # full-attention layers of another shape (Gemma 4)
            full_heads = info.full_kv_heads or info.num_kv_heads
            full_heads = full_heads if engine == "llama.cpp" else max(1, full_heads // tp)
            per_window, per_layer = per_layer, 2 * full_heads * (info.full_head_dim or info.head_dim) * kv_bytes
    sliding = _sliding_set(info)
    window_layers = sum(1 for i in layers if i in sliding)
    window = (info.sliding_window or 0) + batch if window_layers else 0
    linear = sum(1 for i in layers if i in _linear_set(info))
    full = len(layers) - window_layers - linear
    groups = 0 if engine == "llama.cpp" or per_window else hybrid_group_layers((full, window_layers, linear))
    return KvShape(per_layer, full, window_layers, window,
                   linear * linear_state_bytes(info, 1 if engine == "llama.cpp" else tp), per_window, groups)


def engine_kv_tokens(kv: KvShape, budget: float, context: int, profile: EngineProfile = NEWEST) -> int:
    """The tokens a vLLM version prints as its KV cache size ("GPU KV cache size: N tokens") for ``budget``
    bytes on a GPU: before 0.20 its blocks shared among its layer groups (``engine_token_bytes`` a token);
    from 0.20 how many sequences of ``context`` (max_model_len) the cache holds, times that length. Both are
    the cache / bytes per token for a model whose every layer keeps every token."""
    if budget <= 0:
        return 0
    if profile.tokens_by_concurrency:
        one = kv.bytes_for(context)
        return int(budget / one * context) if one else 0
    return int(budget // kv.engine_token_bytes) if kv.engine_token_bytes else 0


def engine_kv_bytes(kv: KvShape, tokens: int, context: int, profile: EngineProfile = NEWEST) -> float:
    """The KV cache bytes behind a count of tokens a vLLM version printed (``engine_kv_tokens`` undone)."""
    if profile.tokens_by_concurrency:
        return tokens / context * kv.bytes_for(context) if context else 0.0
    return float(tokens * kv.engine_token_bytes)


def hybrid_group_layers(kinds: tuple[int, ...]) -> int:
    """vLLM's KV cache groups of a hybrid model (``_get_kv_cache_groups_uniform_page_size``): each kind's layers
    (full attention, sliding window, linear attention) split into groups of the smallest kind's count (the
    largest's when within 1.5x of it), the last of each kind padded; the layers of all groups, 0 for one kind."""
    present = [n for n in kinds if n]
    if len(present) < 2:
        return 0
    size = min(present) if max(present) >= 1.5 * min(present) else max(present)
    return sum(-(-n // size) for n in present) * size


def linear_state_bytes(info: m.ModelInfo, tp: int) -> int:
    """One sequence's state in one gated delta-net layer on one rank: the convolution's last kernel - 1
    inputs (q, k, v in the model's dtype) and the recurrent state (value heads x key dim x value dim)."""
    if not info.linear_layers:
        return 0
    conv = (2 * info.linear_qk_heads * info.linear_qk_head_dim + info.linear_value_heads * info.linear_value_head_dim)
    conv_bytes = conv * (info.linear_conv_kernel - 1) * KV_DTYPE_BYTES
    recurrent = info.linear_value_heads * info.linear_qk_head_dim * info.linear_value_head_dim * info.linear_state_bytes
    return (conv_bytes + recurrent) // max(1, tp)


# --- overhead -------------------------------------------------------------------------------------


def _ffn_width(info: m.ModelInfo) -> int:
    if info.num_experts:
        moe = (info.experts_per_token + info.shared_experts) * info.moe_intermediate_size
        if info.dense_and_moe:
            return moe + info.intermediate_size
        return max(moe, info.intermediate_size if info.first_dense_layers else 0)
    return info.intermediate_size


def overhead_bytes_per_gpu(info: m.ModelInfo, engine: m.Engine, tp: int, pp: int = 1, *,
                           profile: EngineProfile = NEWEST, batch: tuple[int, int] | None = None,
                           cold: bool = True) -> float:
    """Activation peak and the memory outside torch that vLLM counts, from this rank's share, as the
    engine version's ``profile`` counts them; ``batch`` is (max_num_batched_tokens, max_num_seqs). ``cold``: a start
    with no compiled artifact cached (a new replica's first), whose torch.compile transient the profile counts."""
    if engine == "llama.cpp":
        compute = LLAMACPP_UBATCH * 4 * (info.vocab_size + 4 * info.hidden_size + 3 * _ffn_width(info))
        return CUDA_CONTEXT_BYTES + compute
    if info.kv_lora_rank:
        qkv = info.num_attention_heads * (2 * info.qk_nope_head_dim + info.qk_rope_head_dim + info.v_head_dim) // tp
    else:
        qkv = ((info.num_attention_heads // tp) * (2 if info.attn_output_gate else 1) + 2 * kv_heads_per_rank(info, tp)) * info.head_dim
        if info.full_head_dim:  # Gemma 4's full-attention layers: wider heads
            full_kv = max(1, (info.full_kv_heads or info.num_kv_heads) // tp)
            qkv = max(qkv, (info.num_attention_heads // tp + 2 * full_kv) * info.full_head_dim)
    if info.linear_layers:  # a gated delta-net layer's in-projection may be the wider one
        qkv = max(qkv, 2 * (info.linear_qk_heads * info.linear_qk_head_dim
                            + info.linear_value_heads * info.linear_value_head_dim) // tp)
    width = qkv + 4 * info.hidden_size + 3 * _ffn_width(info) // tp
    tokens, seqs = batch or profile.large_batch
    activation = max(tokens * 2 * width, int(profile.copies(tokens) * seqs * info.vocab_size * 4))
    activation += vision_profile_bytes(info, tokens, tp)
    allreduce = int(profile.allreduce_gib * GIB) if tp * pp > 1 else 0
    # On one GPU only: a split start prints the same cold and warm (roy6n23's tp 2 boots, every one 61.29 GiB).
    compile_transient = int(profile.cold_compile_gib * GIB) if cold and tp * pp == 1 else 0
    return activation + compile_transient + int(profile.non_torch_gib * GIB) + allreduce


def vision_profile_bytes(info: m.ModelInfo, batched_tokens: int, tp: int = 1) -> int:
    """What vLLM's profiling run of a multimodal model's vision tower adds to its peak: as many of the
    largest items as its encoder budget (max(max_num_batched_tokens, one item's tokens)) holds, at
    ~(3 x hidden + MLP width) x 2 B per patch, split by tp as the tower's linear layers are, on top of
    the language model's peak. Fitted on the Qwen3.5 / Qwen3-VL tower (1,152 wide, MLP 4,304): Qwen3.5-9B
    on an L40S under vLLM 0.18 (one 65,536-patch image) printed 0.89 GiB more than the language model's
    peak, this gives 0.95; Qwen3-VL-30B-A3B at tp 4 on RTX 3090s under 0.11 (one 614,400-patch video)
    ~2.2, this 2.22. Towers of other families: not modelled."""
    if not info.vision_item_tokens:
        return 0
    items = max(batched_tokens, info.vision_item_tokens) // info.vision_item_tokens
    return items * info.vision_item_patches * info.vision_patch_width * 2 // max(1, tp)


def cuda_graph_bytes_per_gpu(info: m.ModelInfo, tp: int, pp: int = 1, max_num_seqs: int = 256) -> float:
    """What vLLM's CUDA graphs take on the worst rank (an estimate; see GRAPH_* above)."""
    layers = stages(info.num_layers, pp)[0]
    capture = min(GRAPH_CAPTURE_MAX, 2 * max(1, max_num_seqs))
    moe_layers = sum(1 for i in layers if i >= info.first_dense_layers) if info.num_experts else 0
    split = GRAPH_ALLREDUCE_BYTES if tp * pp > 1 else 0
    return (GRAPH_BASE_BYTES + len(layers) * capture * info.hidden_size * GRAPH_BYTES_PER_ELEMENT
            + moe_layers * GRAPH_MOE_LAYER_BYTES * capture // GRAPH_CAPTURE_MAX + split)


def profile_activation_bytes(overhead: float, profile: EngineProfile, tp: int, pp: int = 1) -> float:
    """The part of ``overhead_bytes_per_gpu`` that the profiling run's activation held, not what stays allocated
    (memory outside torch, the all-reduce's buffers)."""
    allreduce = int(profile.allreduce_gib * GIB) if tp * pp > 1 else 0
    return max(0.0, overhead - int(profile.non_torch_gib * GIB) - allreduce)


def capture_headroom(memory: float, util: float, freed: float = 0.0) -> float:
    """What a vLLM that captures its CUDA graphs after sizing its cache has free when it captures: the card beyond
    its budget, less the CUDA context (outside the budget), plus ``freed``, the profiling run's activation where
    the version captures into it (``EngineProfile.capture_reuses_profile``)."""
    return memory - util * memory - CUDA_CONTEXT_BYTES + freed


def gib(b: float) -> float:
    return round(b / GIB, 2)

@lru_cache(maxsize=4096)
def sizes(info: m.ModelInfo, p: Precision, tp: int, pp: int, kv_dtype: str = "auto", gpu_class: str = "", *,
          profile: EngineProfile = NEWEST, batch: tuple[int, int] | None = None,
          cold: bool = True) -> tuple[float, float, KvShape]:
    """Weights, overhead and KV shape per GPU: they depend on the split, the engine version's profile, its
    batch (max_num_batched_tokens, max_num_seqs) and the card (for mxfp4 experts, the kernels vLLM picks on it);
    ``cold``: plan the start that compiles (a replica's first), not one that loads its compiled graphs."""
    kv_bytes = 1 if kv_dtype.startswith("fp8") else KV_DTYPE_BYTES
    return (weight_bytes_per_gpu(info, p, tp, pp, gpu_class, profile),
            overhead_bytes_per_gpu(info, p.engine, tp, pp, profile=profile, batch=batch, cold=cold),
            kv_shape(info, p.engine, tp, pp, kv_bytes))
