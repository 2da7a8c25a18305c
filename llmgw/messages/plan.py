"""The plan service's bodies (``llmgw.plan``, request/reply, not stored)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from llmgw.messages.base import Dim, Label, Parallel, Split, Text
from llmgw.messages.control import Dtype, Engine, ModelSpec

# --- plan service: llmgw.plan (request/reply) --------------------------------


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A model's architecture as its own config.json states it, and its parameter count."""

    name: Text  # repo id ("Qwen/Qwen2.5-14B-Instruct") or directory name
    source: Text  # what the engine loads: the repo id, or the local directory
    model_type: str
    architecture: str
    hidden_size: Dim
    intermediate_size: Dim
    num_layers: Dim
    num_attention_heads: Dim
    num_kv_heads: Dim
    head_dim: Dim
    vocab_size: Dim
    max_position_embeddings: Dim
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    attention_bias: bool = False
    sliding_window: Dim | None = None
    sliding_layers: Annotated[tuple[Dim, ...], msgspec.Meta(max_length=1 << 16)] = ()  # indices of the layers that attend within the window
    num_experts: Dim = 0
    experts_per_token: Dim = 0
    moe_intermediate_size: Dim = 0
    shared_experts: Dim = 0
    first_dense_layers: Dim = 0
    q_lora_rank: Dim = 0
    kv_lora_rank: Dim = 0  # > 0: multi-head latent attention (DeepSeek-V2/V3)
    qk_rope_head_dim: Dim = 0
    qk_nope_head_dim: Dim = 0
    v_head_dim: Dim = 0
    attn_output_gate: bool = False  # q_proj also projects a gate on the attention's output (Qwen3-Next, Qwen3.5)
    # Gemma 4: its full-attention layers have heads of another size and (with k_eq_v) fewer KV heads than
    # its sliding ones (0: the same as the others); its last layers may reuse earlier layers' KV cache;
    # its layers may run a dense MLP beside the experts; small ones add per-layer token embeddings (PLE).
    full_head_dim: Dim = 0
    full_kv_heads: Dim = 0
    kv_shared_layers: Dim = 0
    dense_and_moe: bool = False
    double_wide_shared: bool = False  # the KV-sharing layers' dense MLP is twice as wide
    per_layer_input_size: Dim = 0
    per_layer_vocab: Dim = 0
    # Hybrid models: layers of gated delta-net linear attention (Qwen3-Next, Qwen3.5) keep no KV per token,
    # only a fixed state per sequence: a convolution window and a heads x key x value recurrent state.
    linear_layers: Annotated[tuple[Dim, ...], msgspec.Meta(max_length=1 << 16)] = ()
    linear_qk_heads: Dim = 0  # heads of q and k (the config says "key heads")
    linear_value_heads: Dim = 0
    linear_qk_head_dim: Dim = 0
    linear_value_head_dim: Dim = 0
    linear_conv_kernel: Dim = 0
    linear_state_bytes: Annotated[int, msgspec.Meta(ge=0, le=8)] = 0  # per recurrent state element (fp32: 4)
    vision_params: Annotated[int, msgspec.Meta(ge=0, le=10**13)] = 0  # a multimodal model's vision tower, loaded by vLLM
    # What vLLM's start-up profiling runs through the tower (Qwen-VL-style towers): the largest image's
    # tokens and patches, and the activations per patch (3 x hidden + MLP width, elements).
    vision_item_tokens: Dim = 0
    vision_item_patches: Dim = 0
    vision_patch_width: Dim = 0
    # The checkpoint's own precision when it is pre-quantized: fp8 | int8 | int4 | fp4 | awq | gptq |
    # bnb-4bit | bnb-8bit | None; with the bits each quantized weight takes (scales and zero points
    # included), the modules it leaves 16-bit (its ``ignore`` list), its format, and its KV cache dtype.
    quantization: str | None = None
    quant_bits: Annotated[float, msgspec.Meta(ge=0, le=64)] = 0.0
    quant_ignore: tuple[str, ...] = ()
    quant_format: str = ""  # compressed-tensors | fp8 | awq | gptq | bitsandbytes
    kv_cache_dtype: str = ""  # "fp8" when the checkpoint carries a kv_cache_scheme
    params: Annotated[int, msgspec.Meta(ge=0, le=10**16)] = 0
    params_source: str = ""  # safetensors-index | safetensors-header | hf-metadata | architecture | --params


class PlanRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Ask the planner how a model could be split over the fleet it knows."""

    model: Text
    precisions: Annotated[tuple[Label, ...], msgspec.Meta(max_length=32)] = ()  # empty: every precision the repository can be served at
    tp: Annotated[tuple[Split, ...], msgspec.Meta(max_length=32)] = ()  # empty: 1, 2, 4, 8 where the heads divide
    context: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)] | None = None  # None: the model's full context, else the largest that fits
    # None: the engine version's default (vLLM 0.9 before 0.29, 0.92 from it)
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    params: Annotated[int, msgspec.Meta(ge=1, le=10**16)] | None = None
    all: bool = False
    info: ModelInfo | None = None  # the model as the asker read it; None: the planner resolves it
    parallel: Parallel = 0  # llama.cpp: slots, each holding the context (its KV pool is parallel x context)
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"  # auto: the model's dtype, or the checkpoint's kv_cache_scheme
    # The vLLM version to plan for ("": the one the fleet's agents report, else the newest profile).
    engine_version: Label = ""
    # vLLM's --max-num-seqs (0: the version's default on each card); it sizes the sampler's profiling pass.
    max_num_seqs: Parallel = 0
    # LoRA adapters: vLLM's --max-loras and --max-lora-rank (0: none); llama.cpp's attached adapters' bytes.
    max_adapters: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    max_lora_rank: Annotated[int, msgspec.Meta(ge=0, le=512)] = 0
    adapter_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 44)] = 0


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """One way to run one replica: where, how split, at which precision, and whether it fits."""

    gpu_class: str
    fabric: str | None  # None for a single-node replica: its node's fabric changes nothing
    nodes: int
    tp: int
    pp: int
    precision: str
    engine: Engine
    quantization: str | None
    fits: bool
    reason: str | None
    weights_gib_per_gpu: float
    kv_bytes_per_token_per_gpu: int
    kv_gib_per_gpu: float
    kv_tokens: int
    max_context: int
    replicas_now: int
    # What an agent runs for ``spec(name)`` of the name the plan shows, with what only a node knows
    # (programs, host, port) written one fixed way (llmgw/engine/argv.py, ``shown_command``).
    command: str
    source: str = ""
    context: int = 0  # the max_model_len the command sets
    gpus: int = 1
    gpu_memory_gib: float = 0.0
    gpu_memory_utilization: float = 0.9
    overhead_gib_per_gpu: float = 0.0
    file: str | None = None  # GGUF: the file to download
    file_gib: float | None = None
    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype
    # KV tokens an engine of this very spec reserved on this fleet (then kv_tokens is that
    # figure and the estimate is ``estimated_kv_tokens``); None: never run here.
    observed_kv_tokens: int | None = None
    estimated_kv_tokens: int = 0
    # Over several nodes: what each node runs, the head first (``command`` is the head's vLLM), likewise.
    node_commands: tuple[str, ...] = ()
    parallel: int = 0  # as asked (PlanRequest.parallel); llama.cpp's KV pool is max(1, parallel) x context
    engine_version: str = ""  # the engine version the plan was made for (vLLM; llama.cpp: as reported)
    engine_profile: str = ""  # the overhead profile used, e.g. "vllm 0.21–0.28"
    max_num_seqs: int = 0  # vLLM's --max-num-seqs, planned and passed
    cuda_graph_gib_per_gpu: float = 0.0  # vLLM's CUDA graphs, estimated (0 in eager mode)
    # budget: vLLM takes them from the budget (0.20+); slack: the 1 - utilization slack holds them;
    # charged: it could not, so the utilization was lowered until it does; eager: --enforce-eager
    cuda_graphs: str = ""
    graph_note: str | None = None  # why charged or eager, and what the other choice costs
    enforce_eager: bool = False
    dtype: Dtype = "auto"  # vLLM's --dtype: "auto" runs the checkpoint's own 16-bit type
    # GiB one replica books on each GPU it uses (``llmgw.fleet.state.booking_mib`` of its spec): below
    # ``gpu_memory_gib``, it shares a card with replicas whose bookings fit beside it.
    booked_gib_per_gpu: float = 0.0
    lora_gib_per_gpu: float = 0.0  # what its LoRA adapters take, inside overhead_gib_per_gpu
    max_adapters: int = 0
    max_lora_rank: int = 0

    def spec(self, name: str, replicas: int = 1) -> ModelSpec:
        """The declaration this candidate makes for the scheduler."""
        return ModelSpec(
            name=name,
            source=self.source,
            precision=self.precision,
            engine=self.engine,
            gpu_class=self.gpu_class,
            context=self.context,
            tp=self.tp,
            pp=self.pp,
            replicas=replicas,
            quantization=self.quantization,
            file=self.file,
            gpu_memory_utilization=self.gpu_memory_utilization,
            gib_per_gpu=round(self.weights_gib_per_gpu + self.overhead_gib_per_gpu + self.kv_gib_per_gpu, 2),
            kv_cache_dtype=self.kv_cache_dtype,
            dtype=self.dtype,
            kv_gib_per_gpu=round(self.kv_gib_per_gpu, 3) if self.engine == "vllm" else 0.0,
            # llama.cpp allocates exactly its -c (slots x context), whatever else the card would hold.
            kv_tokens=self.context * max(1, self.parallel) if self.engine == "llama.cpp" else self.kv_tokens,
            # vLLM runs with the --max-num-seqs it was planned for (its sampler's profiling pass depends on it).
            parallel=self.max_num_seqs if self.engine == "vllm" and self.max_num_seqs else self.parallel,
            engine_args=("--enforce-eager",) if self.enforce_eager else (),
            engine_version=self.engine_version,
            max_adapters=self.max_adapters if self.engine == "vllm" else 0,
            max_lora_rank=self.max_lora_rank if self.engine == "vllm" else 0,
        )


class PlanReply(msgspec.Struct, frozen=True, kw_only=True):
    """Every candidate for a model; the JSON that ``ctl model plan --json`` prints."""

    model: str
    params: int
    candidates: tuple[Candidate, ...]
    params_source: str = ""
    context: int | None = None
    fleet_gpus: int = 0
    notes: tuple[str, ...] = ()
    engine_version: str = ""  # the vLLM version planned for
    engine_profile: str = ""  # and the overhead profile that version uses
    engine_version_source: str = ""  # --engine-version | fleet | newest profile


PLAN_REQUEST_DECODER = msgspec.json.Decoder(PlanRequest)
PLAN_REPLY_DECODER = msgspec.json.Decoder(PlanReply)
