"""The planner's pure arithmetic, hand-checked in bytes for every architecture family in examples/models."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw import fleetfile
from llmgw import messages as m
from llmgw.engine.profiles import profile_for
from llmgw.errors import PlanError
from llmgw.fleet import observed as O
from llmgw.fleet.state import FleetState, fold
from llmgw.planner import candidates as P
from llmgw.planner import memory as M
from llmgw.planner import modelinfo

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
MODELS = EXAMPLES / "models"

AT = datetime(2026, 1, 1, tzinfo=UTC)
GIB = 1024**3
MIB = 1024**2
H100_MIB = 81559
V011 = "0.11.0"  # the tests that pin vLLM 0.11's arithmetic plan for it


def model(dirname: str) -> m.ModelInfo:
    """An example model by its repo id, through the models-dir shorthand (so source is the repo id)."""
    return modelinfo.load(dirname.replace("__", "/", 1), models_dir_=MODELS)


LLAMA70 = "meta-llama__Llama-3.3-70B-Instruct"
LLAMA8 = "meta-llama__Llama-3.1-8B-Instruct"
QWEN14 = "Qwen__Qwen2.5-14B-Instruct"
QWEN3 = "Qwen__Qwen3-8B"
GEMMA = "google__gemma-2-9b-it"
MIXTRAL = "mistralai__Mixtral-8x7B-Instruct-v0.1"
DEEPSEEK = "deepseek-ai__DeepSeek-V3"


def fleet(toml: str) -> FleetState:
    return fold(fleetfile.inventories(fleetfile.parse(toml), AT))


def real_fleet(toml: str) -> FleetState:
    """The fleet as real agents report it: the cards size their engines' caches (not simulated)."""
    return fold(msgspec.structs.replace(i, simulated=False) for i in fleetfile.inventories(fleetfile.parse(toml), AT))


def node(name: str, fabric: str, cls: str = "H100-80GB", count: int = 8, mem: int = H100_MIB, unhealthy: str = "") -> str:
    extra = f"\nunhealthy = [{unhealthy}]" if unhealthy else ""
    return (f'[[nodes]]\nname = "{name}"\nfabric = "{fabric}"\ngpu_class = "{cls}"\n'
            f"gpu_count = {count}\ngpu_memory_mib = {mem}{extra}\n")


EXAMPLE_FLEET = fold(fleetfile.inventories(fleetfile.load(EXAMPLES / "fleet.toml"), AT))


# --- KV bytes per token per GPU: layers x 2 x kv_heads_per_rank x head_dim x 2 -----------------

@pytest.mark.parametrize(
    ("dirname", "tp", "expected"),
    [
        (LLAMA70, 1, 80 * 2 * 8 * 128 * 2),  # 327,680: dense GQA
        (LLAMA70, 2, 80 * 2 * 4 * 128 * 2),
        (LLAMA70, 8, 80 * 2 * 1 * 128 * 2),
        (LLAMA8, 1, 32 * 2 * 8 * 128 * 2),
        (QWEN14, 1, 48 * 2 * 8 * 128 * 2),
        (QWEN3, 1, 36 * 2 * 8 * 128 * 2),  # head_dim read from the config
        (GEMMA, 1, 42 * 2 * 8 * 256 * 2),  # head_dim 256, not 3584 / 16 = 224
        (GEMMA, 2, 42 * 2 * 4 * 256 * 2),
        (MIXTRAL, 1, 32 * 2 * 8 * 128 * 2),
        (DEEPSEEK, 1, 61 * (512 + 64) * 2),  # MLA: one latent per layer
        (DEEPSEEK, 8, 61 * (512 + 64) * 2),  # ... replicated on every rank, not split by tp
    ],
)
def test_kv_bytes_per_token_per_gpu(dirname: str, tp: int, expected: int) -> None:
    assert M.kv_shape(model(dirname), "vllm", tp).bytes_per_token == expected


def test_kv_pipeline_stage_holds_its_layers_only() -> None:
    assert M.kv_shape(model(LLAMA70), "vllm", 8, pp=2).bytes_per_token == 40 * 2 * 1 * 128 * 2
    assert M.kv_shape(model(DEEPSEEK), "vllm", 8, pp=2).bytes_per_token == 31 * 576 * 2  # 61 layers: 31 + 30


def test_kv_heads_replicate_beyond_tp() -> None:
    """Past one KV head per rank the heads are replicated, so KV per GPU stops shrinking."""
    info = model(LLAMA70)
    assert M.kv_heads_per_rank(info, 16) == 1
    assert M.kv_shape(info, "vllm", 16).bytes_per_token == M.kv_shape(info, "vllm", 8).bytes_per_token


def test_sliding_window_layers_hold_at_most_window_plus_batch() -> None:
    info = model(GEMMA)
    assert info.sliding_window == 4096
    assert info.sliding_layers == tuple(range(0, 42, 2))
    shape = M.kv_shape(info, "llama.cpp", 1)  # llama.cpp's SWA cache: window + n_ubatch (512)
    assert (shape.full_layers, shape.window_layers, shape.window) == (21, 21, 4096 + 512)
    per_layer = 2 * 8 * 256 * 2
    assert shape.bytes_for(8192) == per_layer * (21 * 8192 + 21 * 4608)
    assert shape.bytes_for(4000) == per_layer * 42 * 4000  # inside the window every layer pays
    vllm = M.kv_shape(info, "vllm", 1)
    assert vllm.window == 4096 + 8192
    # 8 GiB holds more than the window: past it only the 21 global layers grow.
    c = vllm.max_context(8 * GIB)
    assert c == (8 * GIB // per_layer - 21 * 12288) // 21 == 37644
    assert vllm.bytes_for(c) <= 8 * GIB < vllm.bytes_for(c + 1)
    assert vllm.max_context(GIB) == GIB // (42 * per_layer)  # inside the window: every layer


def test_no_sliding_for_qwen2_with_use_sliding_window_false() -> None:
    info = model(QWEN14)
    assert info.sliding_window is None and info.sliding_layers == ()


# --- weights per GPU -------------------------------------------------------------------------------


def test_weights_llama70_bf16_per_rank_hand_checked() -> None:
    info = model(LLAMA70)
    total = 141_107_412_992  # safetensors index: every parameter at 2 bytes
    norms = 2 * (80 * 2 * 8192 + 8192)  # replicated on every rank
    bf16 = M.BY_NAME["bf16"]
    assert M.layout(info, bf16).total == total
    assert M.weight_bytes_per_gpu(info, bf16, 1) == total
    assert M.weight_bytes_per_gpu(info, bf16, 2) == (total - norms) / 2 + norms
    assert M.weight_bytes_per_gpu(info, bf16, 8) == (total - norms) / 8 + norms


def test_weights_pipeline_charges_the_worst_stage() -> None:
    info = model(LLAMA70)
    bf16 = M.BY_NAME["bf16"]
    layer = (8192 * 8192 * 2 + 8192 * 1024 * 2 + 3 * 8192 * 28672) * 2  # q, o, k, v, gate/up/down
    norm = 2 * 8192 * 2
    embd = 128256 * 8192 * 2
    final_norm = 8192 * 2
    # Stage 0: 40 layers + embeddings; stage 1: 40 layers + lm_head (as large) + the final norm: the worst.
    assert M.weight_bytes_per_gpu(info, bf16, 1, pp=2) == 40 * (layer + norm) + embd + final_norm
    assert M.weight_bytes_per_gpu(info, bf16, 8, pp=2) == 40 * (layer / 8 + norm) + embd / 8 + final_norm


def test_moe_counts_every_expert() -> None:
    info = model(MIXTRAL)
    assert (info.num_experts, info.experts_per_token) == (8, 2)
    per_layer_experts = 8 * 3 * 4096 * 14336
    assert M.architecture_params(info) == 46_702_792_704 == info.params
    assert sum(t.params for t in M.tensors(info) if "exps" in t.name) == 32 * per_layer_experts
    assert M.weight_bytes_per_gpu(info, M.BY_NAME["bf16"], 1) == 2 * 46_702_792_704


def test_mla_moe_params_from_architecture() -> None:
    info = model(DEEPSEEK)  # no index: the architecture's own arithmetic
    assert info.params_source == "architecture"
    embd = 129280 * 7168
    attn = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    norms = 2 * 7168 + 1536 + 512
    dense = 3 * 7168 * 18432
    moe = (256 + 1) * 3 * 7168 * 2048 + 7168 * 256
    assert info.params == 2 * embd + 61 * (attn + norms) + 3 * dense + 58 * moe + 7168
    assert 670e9 < info.params < 672e9


def test_tied_embeddings_are_stored_once() -> None:
    info = model(GEMMA)
    assert info.tie_word_embeddings
    assert not any(t.name == "output" for t in M.tensors(info))
    assert M.layout(info, M.BY_NAME["bf16"]).output == 0
    untied = msgspec.structs.replace(info, tie_word_embeddings=False, params=0)
    assert M.architecture_params(untied) - M.architecture_params(msgspec.structs.replace(info, params=0)) == 256000 * 3584


def test_fp8_keeps_embeddings_and_lm_head_in_16_bits() -> None:
    info = model(LLAMA70)
    embd = 128256 * 8192
    norms = 80 * 2 * 8192 + 8192
    matmuls = info.params - 2 * embd - norms
    assert M.layout(info, M.BY_NAME["fp8"]).total == pytest.approx(matmuls * 1 + 2 * embd * 2 + norms * 2)


@pytest.mark.parametrize(("precision", "gib"), [("q8_0", 14.62), ("q4_K_M", 8.37)])
def test_gguf_calibration_qwen25_14b(precision: str, gib: float) -> None:
    """llama.cpp reported 14.62 GiB (q8_0) and 8.37 GiB (q4_K_M) for Qwen2.5-14B."""
    size = M.layout(model(QWEN14), M.BY_NAME[precision.lower()]).total / GIB
    assert size == pytest.approx(gib, rel=0.02)


def test_gguf_k_quant_rules() -> None:
    info = model(QWEN14)
    q4 = M.BY_NAME["q4_k_m"]
    by = {(t.name, t.layer): t for t in M.tensors(info)}
    assert M.gguf_type(q4, by[("output", -1)], info) == "Q6_K"
    assert M.gguf_type(q4, by[("attn_q", 10)], info) == "Q4_K"
    assert M.gguf_type(q4, by[("ffn_down", 0)], info) == "Q6_K"  # first eighth: more bits
    assert M.gguf_type(q4, by[("ffn_down", 8)], info) == "Q6_K"  # (8 - 6) % 3 == 2
    assert M.gguf_type(q4, by[("ffn_down", 9)], info) == "Q4_K"
    odd = M.Tensor("ffn_down", 9, 1056 * 4096, 1056, True, "tp")  # a row of 1056 is no multiple of 256
    assert M.gguf_type(q4, odd, info) == "Q5_0"
    assert M.gguf_type(M.BY_NAME["q6_k"], odd, info) == "Q8_0"
    assert M.gguf_type(q4, by[("norm", 3)], info) == "F32"


# --- fit: the facts people rely on ---------------------------------------------------------------


def one(cands: tuple[m.Candidate, ...], **kw: object) -> m.Candidate:
    found = [c for c in cands if all(getattr(c, k) == v for k, v in kw.items())]
    assert len(found) == 1, (kw, found)
    return found[0]


def test_llama70_bf16_fits_on_two_h100_at_8k_and_not_on_one() -> None:
    info = model(LLAMA70)
    two = fleet(node("n1", "ib-a", count=2))
    req = m.PlanRequest(model=info.name, precisions=("bf16",), context=8192, gpu_memory_utilization=0.95, all=True,
                        engine_version=V011)
    reply = P.plan(info, two, req)
    tp2 = one(reply.candidates, tp=2, precision="bf16")
    tp1 = one(reply.candidates, tp=1, precision="bf16")
    assert tp2.fits and tp2.context == 8192 and tp2.max_context >= 8192
    assert not tp1.fits and "exceed" in (tp1.reason or "")
    # The slack is the unused 5% of the card, reserved once: the KV cache is exactly what is left.
    # vLLM 0.11 captures its CUDA graphs after sizing the cache, out of that slack.
    weights = M.weight_bytes_per_gpu(info, M.BY_NAME["bf16"], 2)
    overhead = M.overhead_bytes_per_gpu(info, "vllm", 2, profile=profile_for("vllm", V011))
    assert tp2.kv_gib_per_gpu == round((0.95 * H100_MIB * MIB - weights - overhead) / GIB, 2)
    assert tp2.kv_tokens == int((0.95 * H100_MIB * MIB - weights - overhead) // 163_840) // 16 * 16
    assert tp2.cuda_graphs == "slack" and tp2.engine_version == V011 and tp2.engine_profile == "vllm 0.11"
    assert tp2.command == ("vllm serve meta-llama/Llama-3.3-70B-Instruct --tensor-parallel-size 2 "
                           "--max-num-seqs 1024 --max-model-len 8192 --gpu-memory-utilization 0.95 "
                           "--host 0.0.0.0 --port 8000 --served-model-name llama-3.3-70b-instruct "
                           "--enable-prompt-tokens-details --enable-force-include-usage")  # what the agent runs
    # From 0.21 vLLM takes its CUDA graphs from the budget: the same card holds less KV cache.
    newer = one(P.plan(info, two, msgspec.structs.replace(req, engine_version="0.27.1")).candidates, tp=2, precision="bf16")
    graphs = M.cuda_graph_bytes_per_gpu(info, 2, 1, 1024)
    overhead = M.overhead_bytes_per_gpu(info, "vllm", 2, profile=profile_for("vllm", "0.27.1"), batch=(8192, 1024))
    assert newer.cuda_graphs == "budget" and newer.cuda_graph_gib_per_gpu == round(graphs / GIB, 2)
    assert newer.kv_gib_per_gpu == round((0.95 * H100_MIB * MIB - weights - overhead - graphs) / GIB, 2)


def test_overhead_is_per_rank_from_the_ranks_share() -> None:
    info = model(LLAMA70)
    # vLLM 0.11 on a large card: the sampler's dummy pass (1024 sequences x vocab x fp32, 9.75 copies as fitted)
    # outweighs the forward pass of 8192 tokens; plus 0.13 GiB outside torch and 0.42 GiB of all-reduce.
    forward = 8192 * 2 * ((32 + 2 * 4) * 128 + 4 * 8192 + 3 * 28672 // 2)
    sampler = int(9.75 * 1024 * 128256 * 4)
    expected = max(forward, sampler) + int(0.13 * GIB) + int(0.42 * GIB)
    assert sampler > forward
    v011 = profile_for("vllm", V011)
    assert M.overhead_bytes_per_gpu(info, "vllm", 2, profile=v011) == expected == 5_712_589_619
    # An A100 or a smaller card gets vLLM's smaller defaults (2048 tokens, 256 sequences).
    small = max(2048 * 2 * ((32 + 2 * 4) * 128 + 4 * 8192 + 3 * 28672 // 2), int(9.75 * 256 * 128256 * 4))
    assert M.overhead_bytes_per_gpu(info, "vllm", 2, profile=v011, batch=(2048, 256)) == small + int(0.13 * GIB) + int(0.42 * GIB)
    assert v011.batch("A100-80GB", 81920) == (2048, 256) and v011.batch("H100-80GB", 81559) == (8192, 1024)
    assert v011.batch("L40S-48GB", 46068) == (2048, 256)
    # From 0.29 the A100 80GB gets the larger defaults too (its 0.31 log: a 1.44 GiB sampler peak).
    assert profile_for("vllm", "0.31.0").batch("A100-80GB", 81920) == (8192, 1024)
    # Newer versions warm the sampler with fewer copies than 0.11's 9.75: ~5 in 0.16-0.20, ~2-3 from 0.21.
    newer = M.overhead_bytes_per_gpu(info, "vllm", 2, profile=profile_for("vllm", "0.17.1"))
    assert newer == max(forward, int(4.75 * 1024 * 128256 * 4)) + int(0.13 * GIB) + int(0.42 * GIB) < expected
    # The forward pass is the rank's share; the sampler's logits are the whole vocabulary on every rank.
    mixtral = model(MIXTRAL)  # a wide MoE MLP and a 32k vocabulary: there the forward pass is the peak at tp 1
    # (beside the split's 0.42 GiB of all-reduce buffers)
    assert (M.overhead_bytes_per_gpu(mixtral, "vllm", 2, profile=v011) - int(0.42 * GIB)
            < M.overhead_bytes_per_gpu(mixtral, "vllm", 1, profile=v011))
    assert M.overhead_bytes_per_gpu(info, "vllm", 8, profile=v011) == M.overhead_bytes_per_gpu(info, "vllm", 2, profile=v011)
    # Not a fraction of the whole model: a bigger parameter count leaves the overhead alone.
    bigger = msgspec.structs.replace(info, params=info.params * 3)
    assert M.overhead_bytes_per_gpu(bigger, "vllm", 2, profile=v011) == expected


def test_full_context_falls_back_to_the_largest_that_fits() -> None:
    info = model(LLAMA70)
    reply = P.plan(info, fleet(node("n1", "ib-a", count=2)), m.PlanRequest(model=info.name, precisions=("bf16",),
                                                                           engine_version=V011))
    c = one(reply.candidates, tp=2)
    assert c.fits and 2048 <= c.max_context < 8192  # bf16 on two H100s at 0.9 (vLLM 0.11): fits, with a short context
    assert c.context == c.max_context and c.max_context % 16 == 0
    assert f"--max-model-len {c.max_context}" in c.command


def test_requested_context_that_does_not_fit_says_why() -> None:
    info = model(LLAMA70)
    reply = P.plan(info, fleet(node("n1", "ib-a", count=2)),
                   m.PlanRequest(model=info.name, precisions=("bf16",), tp=(2,), context=131072, all=True))
    c = one(reply.candidates, tp=2)
    assert not c.fits and "131072-token context" in (c.reason or "") and c.replicas_now == 0
    assert reply.notes and "nothing fits" in reply.notes[0]


# --- the seeds' mistakes cannot come back ------------------------------------------------------------


def test_seed_mistake_attention_heads_instead_of_kv_heads() -> None:
    info = model(LLAMA70)
    wrong = 80 * 2 * 64 * 128 * 2
    right = M.kv_shape(info, "vllm", 1).bytes_per_token
    assert right == 327_680 and wrong == 8 * right
    # A config that says kv heads == attention heads is the only way to get the 8x figure.
    mha = msgspec.structs.replace(info, num_kv_heads=64)
    assert M.kv_shape(mha, "vllm", 1).bytes_per_token == wrong


def test_seed_mistake_slack_reserved_twice() -> None:
    """At 0.95 the 70B fits on two cards; taking another 10% off the 95% would wrongly refuse it."""
    info = model(LLAMA70)
    fits = P.evaluate(info, M.BY_NAME["bf16"], P.Split("H100-80GB", None, H100_MIB, 2), context=8192, util=0.95, replicas_now=1)
    twice = P.evaluate(info, M.BY_NAME["bf16"], P.Split("H100-80GB", None, H100_MIB, 2), context=8192, util=0.95 * 0.9, replicas_now=1)
    assert fits.fits and not twice.fits


def test_seed_mistake_gguf_emitted_as_vllm_profile() -> None:
    reply = P.plan(model(QWEN14), EXAMPLE_FLEET, m.PlanRequest(model="q", all=True))
    assert {c.precision for c in reply.candidates} == {"bf16", "fp8", "q8_0", "q6_K", "q5_K_M", "q4_K_M"}
    for c in reply.candidates:
        if c.precision in M.GGUF_NAMES:
            assert c.engine == "llama.cpp" and c.quantization is None and c.pp == 1
            # A node holding no copy has llama-server download it from the repository.
            assert c.command.startswith(f"llama-server --hf-repo Qwen/Qwen2.5-14B-Instruct "
                                        f"--hf-file Qwen2.5-14B-Instruct-{c.precision.upper()}.gguf -c ")
            assert c.file == f"Qwen2.5-14B-Instruct-{c.precision.upper()}.gguf" and c.file_gib
        else:
            assert c.engine == "vllm" and c.command.startswith("vllm serve Qwen/Qwen2.5-14B-Instruct ")
            assert c.file is None and ".gguf" not in c.command
            assert (c.quantization == "fp8") == (c.precision == "fp8")
            assert ("--quantization fp8" in c.command) == (c.precision == "fp8")


def test_native_fp8_checkpoint_needs_no_quantization_flag_and_refuses_bf16() -> None:
    info = model(DEEPSEEK)
    assert info.quantization == "fp8"
    fp8 = P.evaluate(info, M.BY_NAME["fp8"], P.Split("H200-141GB", None, 143771, 8), context=None, util=0.9, replicas_now=0)
    assert fp8.quantization is None and "--quantization" not in fp8.command
    with pytest.raises(PlanError, match="holds fp8 weights"):
        P.plan(info, EXAMPLE_FLEET, m.PlanRequest(model="d", precisions=("bf16",)))


def test_seed_mistake_single_node_fit_listed_once_per_fabric() -> None:
    reply = P.plan(model(QWEN14), EXAMPLE_FLEET, m.PlanRequest(model="q"))
    singles = [(c.gpu_class, c.tp, c.precision) for c in reply.candidates if c.pp == 1]
    assert singles and len(singles) == len(set(singles))
    assert all(c.fabric is None for c in reply.candidates if c.pp == 1)
    h100 = one(reply.candidates, gpu_class="H100-80GB", tp=1, precision="bf16")
    assert h100.replicas_now == 39  # 5 nodes x 8, one unhealthy GPU, both fabrics


def test_seed_mistake_multi_node_replica_across_two_fabrics() -> None:
    info = model(DEEPSEEK)
    req = m.PlanRequest(model="d", precisions=("fp8",))
    split = fleet(node("a1", "ib-a") + node("b1", "ib-b"))
    assert P.plan(info, split, req).candidates == ()  # one node per fabric: no replica may join them
    same = fleet(node("a1", "ib-a") + node("a2", "ib-a") + node("b1", "ib-b"))
    cands = P.plan(info, same, req).candidates
    assert [(c.fabric, c.nodes, c.tp, c.pp, c.replicas_now) for c in cands] == [("ib-a", 2, 8, 2, 1)]
    assert "--pipeline-parallel-size 2" in cands[0].command


# --- fleet accounting ------------------------------------------------------------------------------


def test_replicas_now_counts_free_healthy_gpus_only() -> None:
    state = fleet(node("n1", "ib-a", unhealthy="0, 1") + node("n2", "ib-a"))
    gpus = tuple(m.GpuRef(node="n2", index=i, uuid=state.nodes["n2"].gpus[i].uuid) for i in range(4))
    spec = m.ModelSpec(name="x", source="x", precision="bf16", engine="vllm", gpu_class="H100-80GB", context=1024, tp=4)
    fold([m.ReplicaPlaced(at=AT, replica_id="r1", model="x", nodes=("n2",), gpus=gpus, spec=spec)], state)
    reply = P.plan(model(LLAMA8), state, m.PlanRequest(model="l", precisions=("bf16",), all=True))
    assert one(reply.candidates, tp=1).replicas_now == 6 + 4
    assert one(reply.candidates, tp=2).replicas_now == 3 + 2
    assert one(reply.candidates, tp=4).replicas_now == 1 + 1
    assert one(reply.candidates, tp=8).replicas_now == 0  # n2 has 8 healthy GPUs, but 4 are held
    assert reply.fleet_gpus == 14


def test_lost_nodes_are_not_planned_on() -> None:
    state = fleet(node("n1", "ib-a"))
    fold([m.NodeLost(at=AT, node="n1")], state)
    reply = P.plan(model(LLAMA8), state, m.PlanRequest(model="l"))
    assert reply.candidates == () and "no live healthy GPUs" in reply.notes[0]


def test_replicas_multi_needs_distinct_nodes() -> None:
    nodes = [P.NodeSlots("a", "f", 8, 8), P.NodeSlots("b", "f", 8, 8), P.NodeSlots("c", "f", 8, 4)]
    assert P.replicas_multi(nodes, 4, 2) == 2  # slots 2, 2, 1: two replicas of 2 stages
    assert P.replicas_multi(nodes, 8, 2) == 1
    assert P.replicas_multi(nodes, 8, 3) == 0


def test_candidates_sorted_fewest_gpus_then_best_precision() -> None:
    reply = P.plan(model(LLAMA70), EXAMPLE_FLEET, m.PlanRequest(model="l", context=8192, engine_version=V011))
    keys = [(c.gpus, M.RANK[c.precision]) for c in reply.candidates]
    assert keys == sorted(keys) and all(c.fits for c in reply.candidates)
    assert reply.candidates[0].gpus == 1 and reply.candidates[0].precision == "q6_K"  # fp8 leaves 0.8 GiB of KV
    # vLLM 0.29's 0.92 utilization would leave fp8 on one H100 room for 8k on a warm start, but a replica's first start
    # compiles its graphs, and that transient (1.09 GiB on one GPU) leaves it short: vLLM's first pick takes two.
    newest = P.plan(model(LLAMA70), EXAMPLE_FLEET, m.PlanRequest(model="l", context=8192)).candidates
    assert (newest[0].gpus, newest[0].precision) == (1, "q6_K")
    first_vllm = next(c for c in newest if c.engine == "vllm")
    assert (first_vllm.gpus, first_vllm.gpu_memory_utilization) == (2, 0.92)


def test_candidate_builds_the_declaration() -> None:
    reply = P.plan(model(QWEN14), EXAMPLE_FLEET, m.PlanRequest(model="q", precisions=("q4_K_M",), tp=(1,)))
    c = reply.candidates[0]
    spec = c.spec("coder", replicas=2)
    assert (spec.name, spec.source, spec.engine, spec.precision, spec.file, spec.tp, spec.replicas) == (
        "coder", "Qwen/Qwen2.5-14B-Instruct", "llama.cpp", "q4_K_M", "Qwen2.5-14B-Instruct-Q4_K_M.gguf", 1, 2)
    assert spec.context == c.context == 32768 and spec.gpu_class == c.gpu_class


# --- absurd requests are refused with the reason -----------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"tp": (3,)}, "does not split the 64 attention heads and 8 KV heads"),
        ({"gpu_memory_utilization": 1.5}, "at most 1"),
        ({"gpu_memory_utilization": 0.0}, "above 0"),
        ({"context": 200_000}, "1 to 131072 tokens"),
        ({"precisions": ("int3",)}, "unknown precision 'int3'"),
        ({"precisions": ("awq",)}, "needs a repository that holds AWQ weights"),
        ({"params": -5}, "positive"),
    ],
)
def test_absurd_requests_are_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        P.plan(model(LLAMA70), EXAMPLE_FLEET, m.PlanRequest(model="l", **kw))  # type: ignore[arg-type]


def test_precision_names_match_case_insensitively() -> None:
    reply = P.plan(model(QWEN14), EXAMPLE_FLEET, m.PlanRequest(model="q", precisions=("Q4_K_M", "BF16"), tp=(1,)))
    assert {c.precision for c in reply.candidates} == {"q4_K_M", "bf16"}


def test_gguf_only_request_may_use_any_gpu_count() -> None:
    reply = P.plan(model(LLAMA70), fleet(node("n", "f", cls="L40S-48GB", count=4, mem=46068)),
                   m.PlanRequest(model="l", precisions=("q4_K_M",), tp=(3,)))
    c = one(reply.candidates, tp=3)
    assert c.fits and c.engine == "llama.cpp"


def test_awq_checkpoint_is_served_as_awq_by_vllm() -> None:
    base = model(QWEN14)
    awq = msgspec.structs.replace(base, quantization="awq", source="Qwen/Qwen2.5-14B-Instruct-AWQ")
    assert [p.name for p in P.available_precisions(awq)] == ["awq", *M.GGUF_NAMES]
    embd = 152064 * 5120
    norms_biases = sum(t.params for t in M.tensors(awq) if not t.matmul) - 2 * embd
    matmuls = awq.params - 2 * embd - norms_biases
    assert M.layout(awq, M.BY_NAME["awq"]).total == pytest.approx(
        matmuls * (4 + 20 / 128) / 8 + (2 * embd + norms_biases) * 2, rel=1e-9)
    c = one(P.plan(awq, EXAMPLE_FLEET, m.PlanRequest(model="a", precisions=("AWQ",), tp=(1,))).candidates,
            gpu_class="L40S-48GB")
    assert c.engine == "vllm" and c.quantization is None and "--quantization" not in c.command
    with pytest.raises(PlanError, match="holds awq weights"):
        P.plan(awq, EXAMPLE_FLEET, m.PlanRequest(model="a", precisions=("bf16",)))


@settings(max_examples=60, deadline=None)
@given(
    dirname=st.sampled_from([LLAMA70, LLAMA8, QWEN14, QWEN3, GEMMA, MIXTRAL, DEEPSEEK]),
    util=st.floats(min_value=0.3, max_value=1.0),
    context=st.one_of(st.none(), st.integers(min_value=1, max_value=8192)),
    mem=st.sampled_from([16384, 24576, 40960, 46068, 81559, 143771]),
)
def test_every_fit_adds_up_within_the_budget(dirname: str, util: float, context: int | None, mem: int) -> None:
    """Whatever the card and request, a candidate that fits holds weights, overhead and its context's KV."""
    info = MODELS_BY_DIR[dirname]
    state = fleet(node("a1", "fa", cls="X-1GB", mem=mem) + node("a2", "fa", cls="X-1GB", mem=mem)
                  + node("b1", "fb", cls="X-1GB", mem=mem))
    reply = P.plan(info, state, m.PlanRequest(model=info.name, context=context, gpu_memory_utilization=util, all=True))
    assert reply.candidates
    for c in reply.candidates:
        p = M.BY_NAME[c.precision.lower()]
        profile = profile_for(c.engine, c.engine_version)
        weights, overhead, kv = M.sizes(info, p, c.tp, c.pp, c.kv_cache_dtype, "X-1GB", profile=profile,
                                        batch=(max(profile.batch("X-1GB", mem)[0], c.max_num_seqs), c.max_num_seqs))
        if c.engine == "llama.cpp":
            weights, overhead, kv = M.sizes(info, p, c.tp, c.pp, c.kv_cache_dtype, "X-1GB")
        if c.fits:
            graphs = c.cuda_graph_gib_per_gpu * GIB if c.cuda_graphs == "budget" else 0
            # The utilization may have been lowered to leave the CUDA graphs room in the slack.
            assert c.gpu_memory_utilization <= util
            assert weights + overhead + graphs + kv.bytes_for(c.context) <= c.gpu_memory_utilization * mem * MIB + 0.01 * GIB
            assert c.context <= c.max_context <= info.max_position_embeddings
            assert c.pp == 1 or c.fabric == "fa"  # only fabric fa has two nodes
            assert (c.fabric is None) == (c.pp == 1)
        else:
            assert c.reason and c.replicas_now == 0


MODELS_BY_DIR = {d: model(d) for d in (LLAMA70, LLAMA8, QWEN14, QWEN3, GEMMA, MIXTRAL, DEEPSEEK)}


# --- candidate 1 ----------------------------------------------------------------------------------


def test_candidate_one_for_70b_on_the_example_fleet_holds_the_common_context() -> None:
    reply = P.plan(model(LLAMA70), EXAMPLE_FLEET, m.PlanRequest(model="l"))
    first = reply.candidates[0]
    assert first.fits and first.context == M.DEFAULT_CONTEXT_CAP and first.max_context >= 32_768
    # The fewest GPUs that hold it, highest precision first; no candidate that holds it uses fewer GPUs.
    holding = [c for c in reply.candidates if c.context >= M.DEFAULT_CONTEXT_CAP]
    assert first.gpus == min(c.gpus for c in holding)
    assert all(M.RANK[first.precision] <= M.RANK[c.precision] for c in holding if c.gpus == first.gpus)
    # Splits that hold less come after every split that holds it, with what they hold.
    kinds = [c.context >= M.DEFAULT_CONTEXT_CAP for c in reply.candidates]
    assert kinds == sorted(kinds, reverse=True)
    short = [c for c in reply.candidates if c.context < M.DEFAULT_CONTEXT_CAP]
    assert all(c.context == c.max_context // 16 * 16 or c.context == c.max_context for c in short)
    # By default one candidate per (class, precision); --all lists every split.
    assert len({(c.gpu_class, c.precision) for c in reply.candidates}) == len(reply.candidates)
    every = P.plan(model(LLAMA70), EXAMPLE_FLEET, m.PlanRequest(model="l", all=True))
    assert len([c for c in every.candidates if c.fits]) > len(reply.candidates)


def test_an_explicit_context_is_what_every_candidate_is_judged_at() -> None:
    reply = P.plan(model(LLAMA70), EXAMPLE_FLEET, m.PlanRequest(model="l", context=8192))
    assert reply.candidates and all(c.context == 8192 for c in reply.candidates)


# --- learning from the fleet ----------------------------------------------------------------------


def _ran_here(state: FleetState, spec: m.ModelSpec, node: str = "n1") -> None:
    gpus = tuple(m.GpuRef(node=node, index=i, uuid=state.nodes[node].gpus[i].uuid) for i in range(spec.tp))
    fold([m.ReplicaPlaced(at=AT, replica_id="x-r1", model="x", nodes=(node,), gpus=gpus, spec=spec)], state)


def test_what_an_engine_reserved_replaces_the_estimate_for_that_very_spec() -> None:
    info = model(LLAMA8)
    state = real_fleet(node("n1", "ib-a"))
    req = m.PlanRequest(model=info.name, precisions=("bf16",), tp=(1,), context=8192)
    before = P.plan(info, state, req).candidates[0]
    assert before.observed_kv_tokens is None and before.kv_tokens == before.estimated_kv_tokens
    spec = before.spec("x")
    assert spec.kv_tokens == before.kv_tokens
    _ran_here(state, spec)
    observed: dict[str, int] = {}
    reserved = before.kv_tokens * 3 // 4
    ok = m.ReplicaStateChanged(at=AT, replica_id="x-r1", model="x", node="n1", state="healthy", observed_kv_tokens=reserved)
    assert O.record_observation(observed, state, ok) is True
    after = P.plan(info, state, req).candidates[0]
    assert after.kv_tokens == before.kv_tokens  # without the observations, the estimate
    after = P.plan(info, state, req, observed=observed).candidates[0]
    assert (after.kv_tokens, after.observed_kv_tokens, after.estimated_kv_tokens) == (reserved, reserved, before.kv_tokens)
    assert after.max_context <= before.max_context
    # Another split or card of the same model is not "this very spec": still the estimate.
    other = P.plan(info, state, m.PlanRequest(model=info.name, precisions=("bf16",), tp=(2,), context=8192),
                   observed=observed).candidates[0]
    assert other.observed_kv_tokens is None
    # A reservation too small for the context asked turns the verdict.
    tiny = m.ReplicaStateChanged(at=AT, replica_id="x-r1", model="x", node="n1", state="healthy", observed_kv_tokens=4096)
    assert O.record_observation(observed, state, tiny) is True
    refused = P.plan(info, state, m.PlanRequest(model=info.name, precisions=("bf16",), tp=(1,), context=8192, all=True),
                     observed=observed).candidates[0]
    assert not refused.fits and refused.max_context < 8192


def test_llama_cpps_reservation_is_what_it_was_asked_never_the_cards_capacity() -> None:
    # llama-server allocates exactly its -c: the figure it reports says nothing about the card.
    info = model(LLAMA8)
    state = real_fleet(node("n1", "ib-a"))
    req = m.PlanRequest(model=info.name, precisions=("q8_0",), tp=(1,), context=1024)
    before = P.plan(info, state, req).candidates[0]
    spec = before.spec("x")
    assert (spec.engine, spec.kv_tokens, spec.kv_tokens_planned) == ("llama.cpp", 1024, 1024)
    _ran_here(state, spec)
    observed: dict[str, int] = {}
    echo = m.ReplicaStateChanged(at=AT, replica_id="x-r1", model="x", node="n1", state="healthy", observed_kv_tokens=512)
    assert O.record_observation(observed, state, echo) is None and observed == {}
    # Even an older fold that kept one does not turn the verdict.
    poisoned = {O.observation_key(info.source, "q8_0", 1, 1, "H100-80GB", 0.9, "auto"): 512}
    assert P.plan(info, state, req, observed=poisoned).candidates[0] == P.plan(info, state, req).candidates[0]


def test_llama_cpp_charges_every_slot_the_whole_context() -> None:
    info = model(LLAMA8)
    state = fleet(node("n1", "ib-a"))

    def q8(context: int | None, parallel: int) -> m.Candidate:
        req = m.PlanRequest(model=info.name, precisions=("q8_0",), tp=(1,), context=context, parallel=parallel, all=True)
        return P.plan(info, state, req).candidates[0]

    one, eight = q8(None, 1), q8(None, 8)
    pool = one.estimated_kv_tokens  # what the card holds; one slot may take all of it (up to the model's context)
    assert one.fits and eight.fits and eight.max_context * 8 <= pool < (eight.max_context + P.LLAMACPP_CTX_PAD) * 8
    assert q8(100_000, 1).fits and 100_000 * 8 > pool
    refused = q8(100_000, 8)
    assert not refused.fits and "in each of 8 slots" in (refused.reason or "")
    spec = q8(4096, 8).spec("x")
    assert (spec.parallel, spec.context, spec.kv_tokens) == (8, 4096, 32768)
    assert "-c 32768 -np 8" in q8(4096, 8).command


def test_implausible_or_foreign_reservations_are_refused() -> None:
    info = model(LLAMA8)
    state = real_fleet(node("n1", "ib-a") + node("n2", "ib-a"))
    spec = P.plan(info, state, m.PlanRequest(model=info.name, precisions=("bf16",), tp=(1,), context=8192)).candidates[0].spec("x")
    _ran_here(state, spec)
    observed: dict[str, int] = {}

    def report(node: str, tokens: int, rid: str = "x-r1") -> bool | None:
        return O.record_observation(observed, state, m.ReplicaStateChanged(
            at=AT, replica_id=rid, model="x", node=node, state="healthy", observed_kv_tokens=tokens))

    assert report("n1", 0) is None  # nothing reported
    assert report("n1", -5) is False
    assert report("n1", spec.kv_tokens * 5) is False  # more than the card could hold
    assert report("n1", 10**12) is False
    assert report("n2", 1000) is False  # n2 does not run x-r1
    assert report("n1", 1000, rid="nobody") is False
    assert observed == {}


def test_an_observation_is_kept_only_under_the_arguments_that_sized_it() -> None:
    """vLLM on CPU sized its cache from VLLM_CPU_KVCACHE_SPACE and ran --dtype=float32 (2 KiB a token):
    kept as the card's capacity under a key without its arguments, it cut the next bf16 plan's KV to 0.5 GiB."""
    info = model(LLAMA8)
    req = m.PlanRequest(model=info.name, precisions=("bf16", "fp16"), tp=(1,), context=8192, all=True)
    state = real_fleet(node("n1", "ib-a") + node("n2", "ib-a"))
    plan = {c.precision: c for c in P.plan(info, state, req).candidates if c.gpu_class == "H100-80GB"}
    bf16 = plan["bf16"].spec("x")
    sim = fold(msgspec.structs.replace(i, node="sim", simulated=True)
               for i in fleetfile.inventories(fleetfile.parse(node("sim", "ib-a")), AT))

    def ran(spec: m.ModelSpec, where: FleetState = state, node: str = "n1") -> tuple[bool | None, dict[str, int]]:
        observed: dict[str, int] = {}
        _ran_here(where, spec, node)
        kept = O.record_observation(observed, where, m.ReplicaStateChanged(
            at=AT, replica_id="x-r1", model="x", node=node, state="healthy", observed_kv_tokens=4096))
        return kept, observed

    def used(observed: dict[str, int]) -> dict[str, int | None]:
        return {c.precision: c.observed_kv_tokens for c in P.plan(info, state, req, observed=observed).candidates
                if c.gpu_class == "H100-80GB"}

    # The engine's own arguments are part of the key: a float32 run says nothing of a bf16 plan.
    for args in (("--dtype=float32",), ("--dtype", "float"), ("--kv-cache-dtype", "fp8"), ("--block-size=32",),
                 ("--gpu-memory-utilization", "0.5")):
        kept, observed = ran(msgspec.structs.replace(bf16, engine_args=args))
        assert kept is True and used(observed) == {"bf16": None, "fp16": None}, args
    # Arguments that size nothing leave the key alone, and the spec's own --dtype is the plan's.
    kept, observed = ran(msgspec.structs.replace(bf16, engine_args=("--enable-prefix-caching", "--dtype=bfloat16")))
    assert kept is True and used(observed) == {"bf16": 4096, "fp16": None}
    assert plan["fp16"].spec("x").dtype == "float16"
    assert used(ran(plan["fp16"].spec("x"))[1]) == {"bf16": None, "fp16": 4096}
    # A cache sized outright, or on a simulated node, is no card's capacity: nothing is kept.
    assert ran(msgspec.structs.replace(bf16, engine_args=("--kv-cache-memory-bytes", "1073741824"))) == (None, {})
    assert ran(msgspec.structs.replace(bf16, engine_args=("--num-gpu-blocks-override=256",))) == (None, {})
    assert ran(bf16, sim, "sim") == (None, {})
