"""Pre-quantized checkpoints sized from their own quantization_config, and the KV cache dtype.

The configs are the 16-bit example models' config.json with the quantization_config
that llm-compressor, AutoAWQ, GPTQ and bitsandbytes write (the formats vLLM reads);
real repositories' configs and stated sizes are in ``tests/data/quantized/``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from llmgw import fleetfile
from llmgw import messages as m
from llmgw.errors import ModelError, PlanError
from llmgw.fleet.state import fold
from llmgw.planner import candidates as P
from llmgw.planner import memory as M
from llmgw.planner import modelinfo

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "examples" / "models"
QUANTIZED = Path(__file__).resolve().parent / "data" / "quantized"
FLEET = fold(fleetfile.inventories(fleetfile.load(ROOT / "examples" / "fleet.toml"), datetime(2026, 1, 1, tzinfo=UTC)))
GIB = 1024**3

FP8_DYNAMIC = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"], "kv_cache_scheme": None,
    "config_groups": {"group_0": {"targets": ["Linear"],
                                  "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
}
W8A8 = {**FP8_DYNAMIC, "format": "int-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}}}}
W4A16 = {**FP8_DYNAMIC, "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}}}}


def quantized(base: str, qc: dict[str, Any], tmp_path: Path) -> m.ModelInfo:
    """An example model's config with a quantization_config, read as the planner reads a checkpoint."""
    cfg = json.loads((MODELS / base / "config.json").read_text())
    cfg["quantization_config"] = qc
    d = tmp_path / base
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return modelinfo.load_dir(d)


def split_params(info: m.ModelInfo) -> tuple[int, int]:
    """(matmul, other) parameters of the architecture."""
    ts = M.tensors(info)
    return sum(t.params for t in ts if t.matmul), sum(t.params for t in ts if not t.matmul)


@pytest.mark.parametrize(("qc", "precision", "bits"), [(FP8_DYNAMIC, "fp8", 8.0), (W8A8, "int8", 8.0),
                                                        (W4A16, "int4", 4 + 16 / 128)])
def test_compressed_tensors_checkpoints_are_sized_from_their_scheme(qc: dict[str, Any], precision: str, bits: float,
                                                                    tmp_path: Path) -> None:
    info = quantized("meta-llama__Llama-3.1-8B-Instruct", qc, tmp_path)
    assert (info.quantization, info.quant_format, info.quant_bits) == (precision, "compressed-tensors", bits)
    matmul, other = split_params(info)
    # Hand-checked: quantized matmuls at their bits, embeddings, lm_head (ignored) and norms at 16.
    assert M.layout(info, M.precision(precision)).total == pytest.approx((matmul * bits + other * 16) / 8)
    reply = P.plan(info, FLEET, m.PlanRequest(model=info.name))
    assert {c.precision for c in reply.candidates} >= {precision}
    own = [c for c in reply.candidates if c.precision == precision]
    assert own and all(c.quantization is None and "--quantization" not in c.command for c in own)  # vLLM reads the config
    with pytest.raises(PlanError, match=f"holds {precision} weights"):
        P.plan(info, FLEET, m.PlanRequest(model=info.name, precisions=("bf16",)))


def test_ignored_layers_stay_16_bit(tmp_path: Path) -> None:
    plain = quantized("meta-llama__Llama-3.1-8B-Instruct", FP8_DYNAMIC, tmp_path)
    (tmp_path / "b").mkdir()
    first_last = quantized("meta-llama__Llama-3.1-8B-Instruct",
                           {**FP8_DYNAMIC, "ignore": ["lm_head", "re:model.layers.0\\..*", "model.layers.31.mlp.down_proj"]},
                           tmp_path / "b")
    layer0 = sum(t.params for t in M.tensors(plain) if t.layer == 0 and t.matmul)
    down31 = next(t.params for t in M.tensors(plain) if t.layer == 31 and t.name == "ffn_down")
    fp8 = M.precision("fp8")
    assert M.layout(first_last, fp8).total - M.layout(plain, fp8).total == pytest.approx((layer0 + down31) * 1.0)


def test_kv_cache_scheme_and_the_kv_flag_halve_the_cache(tmp_path: Path) -> None:
    info = quantized("meta-llama__Llama-3.1-8B-Instruct",
                     {**FP8_DYNAMIC, "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}, tmp_path)
    assert info.kv_cache_dtype == "fp8"
    ours = P.plan(info, FLEET, m.PlanRequest(model=info.name, precisions=("fp8",), tp=(1,), context=8192))
    plain = modelinfo.load_dir(MODELS / "meta-llama__Llama-3.1-8B-Instruct")
    asked = P.plan(plain, FLEET, m.PlanRequest(model=plain.name, precisions=("fp8",), tp=(1,), context=8192,
                                               kv_cache_dtype="fp8"))
    auto = P.plan(plain, FLEET, m.PlanRequest(model=plain.name, precisions=("fp8",), tp=(1,), context=8192))
    for reply in (ours, asked):
        c = reply.candidates[0]
        assert c.kv_cache_dtype == "fp8" and "--kv-cache-dtype fp8" in c.command
        assert c.kv_bytes_per_token_per_gpu * 2 == auto.candidates[0].kv_bytes_per_token_per_gpu
        assert c.spec("x").kv_cache_dtype == "fp8"
    assert auto.candidates[0].kv_cache_dtype == "auto" and "--kv-cache-dtype" not in auto.candidates[0].command
    # llama.cpp keeps its f16 cache whatever is asked.
    gguf = P.plan(plain, FLEET, m.PlanRequest(model=plain.name, precisions=("q8_0",), tp=(1,), context=8192,
                                              kv_cache_dtype="fp8"))
    assert gguf.candidates[0].kv_cache_dtype == "auto"


@pytest.mark.parametrize(("qc", "precision", "bits"), [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}, "awq", 4 + 20 / 128),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False, "sym": True}, "gptq", 8 + 24 / 128),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
      "bnb_4bit_use_double_quant": True}, "bnb-4bit", 4 + 8 / 64 + 32 / (64 * 256)),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "bnb-8bit", 8.0),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, "fp8", 8 + 32 / 16384),
])
def test_other_checkpoint_formats(qc: dict[str, Any], precision: str, bits: float, tmp_path: Path) -> None:
    info = quantized("Qwen__Qwen2.5-14B-Instruct", qc, tmp_path)
    assert (info.quantization, info.quant_bits) == (precision, pytest.approx(bits))
    assert P.available_precisions(info)[0].name == precision
    reply = P.plan(info, FLEET, m.PlanRequest(model=info.name, precisions=(precision,)))
    assert reply.candidates and all("--quantization" not in c.command for c in reply.candidates)


def test_a_method_the_planner_cannot_size_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="is a hqq checkpoint, which the planner cannot size; it sizes "
                                         "compressed-tensors .* plan the 16-bit repository"):
        quantized("Qwen__Qwen3-8B", {"quant_method": "hqq"}, tmp_path)
    with pytest.raises(ModelError, match="a ModelOpt checkpoint of no stated quant_algo"):
        modelinfo.quantization({"quant_method": "modelopt"}, "nvidia/x")


def real(name: str) -> dict[str, Any]:
    return dict(json.loads((QUANTIZED / f"{name}.json").read_text()))


@pytest.mark.parametrize(("name", "precision", "bits", "kv"), [
    ("cortecs__Llama-3.3-70B-Instruct-FP8-Dynamic", "fp8", 8.0, ""),
    ("amd__Llama-3.1-8B-Instruct-FP8-KV", "fp8", 8.0, "fp8"),
    ("dwetzel__Meta-Llama-3.1-70B-Instruct-W4A16-G128", "int4", 4 + 16 / 128, ""),
    ("TheBloke__Llama-2-13B-chat-GPTQ__gptq-8bit-64g-actorder_True", "gptq", 8 + 24 / 64, ""),
    ("aiplanet__LuxLlama", "bnb-4bit", 4 + 8 / 64 + 32 / (64 * 256), ""),
])
def test_real_checkpoint_configs_are_read(name: str, precision: str, bits: float, kv: str) -> None:
    cfg = real(name)
    qc = modelinfo.stated_quantization(cfg)
    q = modelinfo.quantization(qc, name)
    assert (q.precision, q.bits, q.kv_cache_dtype) == (precision, pytest.approx(bits), kv)


@pytest.mark.parametrize(("base", "scheme_from", "stated_bytes"), [
    ("meta-llama__Llama-3.1-8B-Instruct", "cortecs__Llama-3.3-70B-Instruct-FP8-Dynamic", 9.08e9),
    ("meta-llama__Llama-3.1-8B-Instruct", "dwetzel__Meta-Llama-3.1-70B-Instruct-W4A16-G128", 5.74e9),
    ("meta-llama__Llama-3.3-70B-Instruct", "dwetzel__Meta-Llama-3.1-70B-Instruct-W4A16-G128", 39.8e9),
])
def test_sizes_agree_with_what_the_repositories_state(base: str, scheme_from: str, stated_bytes: float,
                                                      tmp_path: Path) -> None:
    cfg = real(scheme_from)
    info = quantized(base, cfg.get("quantization_config") or cfg["compression_config"], tmp_path)
    total = M.layout(info, M.precision(str(info.quantization))).total
    assert total == pytest.approx(stated_bytes, rel=0.03)  # tests/data/quantized/SOURCES.md


GPT_OSS = Path(__file__).resolve().parent / "data" / "calibration"


def gpt_oss(size: str) -> m.ModelInfo:
    return modelinfo.load_dir(GPT_OSS / f"openai__gpt-oss-{size}")


def test_gpt_oss_is_read_as_an_mxfp4_checkpoint() -> None:
    info = gpt_oss("20b")
    assert (info.quantization, info.quant_format, info.quant_bits) == ("mxfp4", "mxfp4", 4.25)  # e8m0 per 32 fp4
    assert "model.layers.*.self_attn" in info.quant_ignore
    assert P.available_precisions(info)[0].name == "mxfp4"


@pytest.mark.parametrize(("size", "total_size"), [("20b", 13_761_264_768), ("120b", 65_248_815_744)])
def test_gpt_oss_checkpoint_agrees_with_its_index(size: str, total_size: int) -> None:
    # model.safetensors.index.json metadata.total_size of openai/gpt-oss-* (tests/data/calibration/SOURCES.md):
    # experts in fp4 with an e8m0 scale per 32, everything else (attention, router, sinks, biases) in bf16.
    info = gpt_oss(size)
    assert M.layout(info, M.precision("mxfp4")).total == pytest.approx(total_size, rel=0.005)


def vllm_mxfp4_gib(layers: int, experts: int, tp: int, hidden_align: int = 256, inter_align: int = 128) -> float:
    """Hand-count of what vLLM holds per GPU for gpt-oss (mxfp4.py's create_weights, Marlin padding)."""
    h, vocab, heads, kv, hd = 2880, 201088, 64, 8, 64
    i = -(-(2880 // tp) // inter_align) * inter_align  # intermediate per rank, padded
    hp = -(-h // hidden_align) * hidden_align
    experts_b = experts * (2 * i * hp // 2 + hp * i // 2 + 2 * i * hp // 32 + hp * i // 32 + (2 * i + hp) * 2)
    q, kvw = heads // tp * hd, max(1, kv // tp) * hd
    attn = 2 * (h * q + q + 2 * (h * kvw + kvw) + q * h + h + heads // tp)  # q/k/v/o with biases, sinks
    other = 2 * (h * experts + experts + 2 * h)  # router and its bias, two norms
    return (layers * (experts_b + attn + other) + 2 * 2 * vocab // tp * h + 2 * h) / GIB


@pytest.mark.parametrize(("size", "layers", "experts", "tp", "observed"), [
    ("20b", 24, 32, 1, 13.47), ("20b", 24, 32, 2, None), ("120b", 36, 128, 1, 64.38), ("120b", 36, 128, 2, None),
    ("120b", 36, 128, 4, 17.2217),
])
def test_gpt_oss_weights_per_gpu_follow_vllms_padded_layout(size: str, layers: int, experts: int, tp: int,
                                                            observed: float | None) -> None:
    info = gpt_oss(size)
    weights = M.weight_bytes_per_gpu(info, M.precision("mxfp4"), tp) / GIB
    assert weights == pytest.approx(vllm_mxfp4_gib(layers, experts, tp), rel=1e-3)
    # The 2,880-wide experts are padded (to 3,072 x 2,944 at tp1): more than the rank's share of the file.
    assert weights > M.layout(info, M.precision("mxfp4")).total / tp / GIB
    if observed is not None:  # vLLM's "Model loading took" (tests/data/vllm_observed.jsonl)
        assert weights == pytest.approx(observed, rel=0.03)


def test_gpt_oss_on_blackwell_is_charged_flashinfers_wider_padding() -> None:
    info = gpt_oss("20b")
    mx = M.precision("mxfp4")
    b200 = M.weight_bytes_per_gpu(info, mx, 1, gpu_class="B200-180GB") / GIB
    assert b200 == pytest.approx(vllm_mxfp4_gib(24, 32, 1, inter_align=256), rel=1e-3)
    assert b200 > M.weight_bytes_per_gpu(info, mx, 1, gpu_class="H100-80GB") / GIB


def test_gpt_oss_plans_name_mxfp4_and_pass_no_quantization_flag() -> None:
    for size, tp in (("20b", 1), ("120b", 2)):
        info = gpt_oss(size)
        reply = P.plan(info, FLEET, m.PlanRequest(model=info.name, precisions=("mxfp4",), tp=(tp,)))
        fits = [c for c in reply.candidates if c.fits and c.gpu_class == "H100-80GB"]
        assert fits, reply
        c = fits[0]
        assert c.precision == "mxfp4" and c.quantization is None and "--quantization" not in c.command
        expected = M.weight_bytes_per_gpu(info, M.precision("mxfp4"), tp, gpu_class="H100-80GB") / GIB
        assert c.weights_gib_per_gpu == pytest.approx(expected, abs=0.01)
    with pytest.raises(PlanError, match="holds mxfp4 weights"):
        P.plan(gpt_oss("20b"), FLEET, m.PlanRequest(model="openai/gpt-oss-20b", precisions=("bf16",)))


def test_mxfp4_outside_moe_experts_is_refused(tmp_path: Path) -> None:
    # vLLM runs mxfp4 only in fused MoE experts; a dense model's linears would load as bf16.
    with pytest.raises(ModelError, match="mxfp4 .* MoE experts"):
        quantized("Qwen__Qwen3-8B", {"quant_method": "mxfp4"}, tmp_path)


def test_modelopt_nvfp4_keeps_what_it_ignores_in_16_bits() -> None:
    """nvidia/Gemma-4-31B-IT-NVFP4: 4-bit floats with an fp8 scale per 16, every layer's attention and
    the vision tower left in bf16 under the multimodal wrapper's names, an fp8 KV cache."""
    cfg = real("nvidia__Gemma-4-31B-IT-NVFP4")
    info = modelinfo.from_config(cfg, name="nvidia/Gemma-4-31B-IT-NVFP4", source="x")
    assert (info.quantization, info.quant_bits, info.quant_format, info.kv_cache_dtype) == ("fp4", 4.5, "modelopt", "fp8")
    kept = M.ignored(info)
    layers = cfg["text_config"]["num_hidden_layers"]
    assert {(n, i) for n in ("attn_q", "attn_k", "attn_v", "attn_output") for i in range(layers)} == kept
    p = M.precision("fp4")
    bits = {t.name: M.tensor_bits(p, t, info) / t.params for t in M.tensors(info) if t.layer == 0}
    assert bits["attn_q"] == 16 and bits["ffn_up"] == 4.5


def test_an_older_modelopt_checkpoint_states_its_quantization_beside_its_config(tmp_path: Path) -> None:
    """nvidia/Llama-3.1-70B-Instruct-FP8: config.json says nothing, hf_quant_config.json says FP8 (as vLLM reads it)."""
    folder = tmp_path / "nvidia__Llama-3.1-70B-Instruct-FP8"
    folder.mkdir()
    (folder / "config.json").write_text((MODELS / "meta-llama__Llama-3.3-70B-Instruct" / "config.json").read_text())
    (folder / "hf_quant_config.json").write_text((QUANTIZED / "nvidia__Llama-3.1-70B-Instruct-FP8.hf_quant_config.json").read_text())
    info = modelinfo.load_dir(folder)
    assert (info.quantization, info.quant_bits, info.quant_format, info.kv_cache_dtype) == ("fp8", 8.0, "modelopt", "fp8")
    assert info.quant_ignore == ("lm_head",)
    plan = P.plan(info, FLEET, m.PlanRequest(model=info.name, tp=(2,)))
    served = [c for c in plan.candidates if c.engine == "vllm"]
    assert served and {c.precision for c in served} == {"fp8"}
    assert all("--quantization" not in c.command and "--kv-cache-dtype fp8" in c.command for c in served)
    (folder / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "W4A8_AWQ"}}')
    with pytest.raises(ModelError, match="ModelOpt checkpoint of W4A8_AWQ quant_algo"):
        modelinfo.load_dir(folder)
