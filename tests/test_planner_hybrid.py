"""Hybrid models: gated delta-net layers (Qwen3-Next, Qwen3.5) keep a state per sequence, not KV per token.

Before the planner knew linear attention it read Qwen3.5-27B as 64 attention layers: 24.35B parameters
instead of ~27B, and four times the KV per token, so it refused contexts that serve. Mamba hybrids
(Nemotron-H, Jamba, Granite 4) are refused with a reason rather than planned wrong.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from llmgw import messages as m
from llmgw.engine.profiles import profile_for
from llmgw.errors import ModelError
from llmgw.planner import candidates as P
from llmgw.planner import memory as M
from llmgw.planner import modelinfo

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_planner_math import fleet, node  # noqa: E402

GIB = 1024**3
CONFIGS = Path(__file__).resolve().parent / "data" / "calibration"
DENSE = CONFIGS / "Qwen__Qwen3.5-27B"
MOE = CONFIGS / "Qwen__Qwen3.5-35B-A3B"
MAMBA = CONFIGS / "nvidia__NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"


def load(folder: Path) -> m.ModelInfo:
    return modelinfo.load_dir(folder)


def text_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["text_config"]


def test_only_the_full_attention_layers_keep_kv_per_token() -> None:
    info = load(DENSE)
    cfg = text_config(DENSE)
    full = [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"]
    assert len(full) == 16 and len(info.linear_layers) == 48 and set(info.linear_layers).isdisjoint(full)
    shape = M.kv_shape(info, "vllm", 1)
    # 16 layers x K and V x 4 KV heads x 256 x bf16, where the old reading charged all 64 layers.
    assert shape.bytes_per_token == 16 * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    # A sequence's state: per linear layer the convolution's last 3 inputs of q, k, v (bf16) and
    # the fp32 recurrent state of 48 value heads x 128 x 128, whatever the sequence's length.
    conv = (2 * 16 * 128 + 48 * 128) * 3 * 2
    recurrent = 48 * 128 * 128 * 4
    assert shape.bytes_for(0) == 48 * (conv + recurrent)
    assert shape.bytes_for(1000) - shape.bytes_for(0) == 1000 * shape.bytes_per_token
    assert shape.max_context(shape.bytes_for(5000)) == 5000
    # Split over two ranks, each holds half of every head group's state and of the KV heads.
    half = M.kv_shape(info, "vllm", 2)
    assert half.state == shape.state // 2 and half.bytes_per_token == shape.bytes_per_token // 2


def test_qwen3_next_without_layer_types_reads_its_interval() -> None:
    cfg = {**json.loads((DENSE / "config.json").read_text()), "text_config": {
        k: v for k, v in text_config(DENSE).items() if k != "layer_types"}}
    info = modelinfo.from_config(cfg, name="x/y", source="x/y")
    assert info.linear_layers == load(DENSE).linear_layers


def test_the_parameters_count_linear_layers_the_output_gate_and_the_vision_tower() -> None:
    dense, moe = load(DENSE), load(MOE)
    # The published sizes: 27B and 35B total (language model, vision tower; the MTP head is not loaded).
    assert 26.5e9 < dense.params < 28e9, dense.params
    assert 34.5e9 < moe.params < 36e9, moe.params
    assert 0.3e9 < dense.vision_params < 0.6e9
    assert moe.shared_experts == 1 and moe.experts_per_token == 8
    no_vision = msgspec.structs.replace(dense, vision_params=0, params=0)
    bf16, q4 = M.precision("bf16"), M.precision("q4_K_M")
    # vLLM loads the vision tower (on the first stage, split by tp); a GGUF leaves it to its mmproj file.
    with_tower = M.weight_bytes_per_gpu(msgspec.structs.replace(dense, params=0), bf16, 1)
    assert with_tower - M.weight_bytes_per_gpu(no_vision, bf16, 1) == pytest.approx(dense.vision_params * 2, rel=1e-6)
    assert M.layout(msgspec.structs.replace(dense, params=0), q4).total == pytest.approx(M.layout(no_vision, q4).total)


def test_a_hybrid_plan_holds_the_context_its_attention_layers_allow() -> None:
    info = load(DENSE)
    state = fleet(node("n1", "fa", cls="H100-80GB", count=1))
    req = m.PlanRequest(model=info.name, precisions=("bf16",), tp=(1,), engine_version="0.29.0")
    c = P.plan(info, state, req).candidates[0]
    shape = M.kv_shape(info, "vllm", 1)
    # From 0.20 vLLM counts its tokens as sequences of max_model_len that fit, times that length: the state is paid.
    context = min(info.max_position_embeddings, 32768)
    assert c.fits and c.kv_tokens == pytest.approx(c.kv_gib_per_gpu * GIB / shape.bytes_for(context) * context, rel=1e-3)
    # Its full 262,144-token context fits on one H100: as 64 attention layers it would need 64 GiB of KV.
    assert c.max_context == info.max_position_embeddings == 262144
    assert shape.bytes_for(262144) < c.kv_gib_per_gpu * GIB < 4 * 262144 * shape.bytes_per_token


def test_before_0_20_a_hybrids_token_costs_its_attention_and_linear_layers_pages() -> None:
    """Qwen3.5-27B at tp 4 on RTX 3090s under vLLM 0.19.0 (https://github.com/leadawon/LAMBO, logs/vllm_serve.log:
    "Available KV cache memory: 7.8 GiB", "GPU KV cache size: 127,008 tokens"): its hybrid allocator gives the 48
    linear layers pages of the 16 attention layers' size, so a token of its count costs 64 layers' worth (one KV
    head of 256 a rank: 1 KiB a layer), a quarter of what the attention layers alone would count."""
    info = load(DENSE)
    shape = M.kv_shape(info, "vllm", 4)
    assert (shape.per_layer, shape.full_layers, shape.group_layers) == (2 * 1 * 256 * 2, 16, 64)
    assert shape.engine_token_bytes == 64 * 1024 == 4 * shape.bytes_per_token
    v019 = profile_for("vllm", "0.19.0")
    assert M.engine_kv_tokens(shape, 7.8 * GIB, 100_000, v019) == pytest.approx(127_008, rel=0.02)
    state = fleet(node("n1", "fa", cls="RTX3090-24GB", count=4, mem=24576))
    req = m.PlanRequest(model=info.name, precisions=("bf16",), tp=(4,), context=100_000, engine_version="0.19.0",
                        gpu_memory_utilization=0.93)
    c = P.plan(info, state, req).candidates[0]
    # The plan's tokens per GiB are the log's (127,008 / 7.8 GiB), not four times as many.
    assert c.kv_tokens / c.kv_gib_per_gpu == pytest.approx(127_008 / 7.8, rel=0.02)


def test_mamba_hybrids_are_refused_with_the_reason() -> None:
    with pytest.raises(ModelError, match="mamba"):
        load(MAMBA)
    cfg = {**text_config(DENSE), "layer_types": ["mamba", "full_attention"] * 32}
    with pytest.raises(ModelError, match="mamba"):
        modelinfo.from_config(cfg, name="x/y", source="x/y")
    odd = {**text_config(DENSE), "layer_types": ["conv", "full_attention"] * 32}
    with pytest.raises(ModelError, match="kind conv"):
        modelinfo.from_config(odd, name="x/y", source="x/y")


def test_ctl_model_plan_refuses_a_mamba_hybrid_in_one_line(tmp_path: Path) -> None:
    from llmgw.cli.main import cli

    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text(node("n1", "fa", count=1))
    out = CliRunner().invoke(cli, ["ctl", "model", "plan", str(MAMBA), "--fleet", str(fleet_file)])
    assert out.exit_code == 1 and out.output.startswith("Error: ") and "mamba" in out.output, out.output
    assert "Traceback" not in out.output


def test_vllms_profiling_of_the_vision_tower_is_charged_by_its_encoder_budget() -> None:
    """Qwen3.5-9B on an L40S under vLLM 0.18 (tests/data/vllm_observed.jsonl): 0.89 GiB more peak than the
    language model's, as vLLM pushes one largest image (16,384 tokens = 65,536 patches) through the tower."""
    info = load(CONFIGS / "Qwen__Qwen3.5-9B")
    vc = json.loads((CONFIGS / "Qwen__Qwen3.5-9B" / "config.json").read_text())["vision_config"]
    assert (info.vision_item_tokens, info.vision_item_patches) == (16384, 16384 * vc["spatial_merge_size"] ** 2)
    per_image = info.vision_item_patches * (3 * vc["hidden_size"] + vc["intermediate_size"]) * 2
    text_only = msgspec.structs.replace(info, vision_item_tokens=0)
    for tokens, images in ((2048, 1), (16384, 1), (40000, 2), (65536, 4)):
        batch = (tokens, 256)
        extra = M.overhead_bytes_per_gpu(info, "vllm", 1, batch=batch) - M.overhead_bytes_per_gpu(text_only, "vllm", 1, batch=batch)
        assert extra == images * per_image, tokens
    assert 0.85 * GIB < per_image < 1.0 * GIB
    assert M.overhead_bytes_per_gpu(info, "llama.cpp", 1) == M.overhead_bytes_per_gpu(text_only, "llama.cpp", 1)
    # The tower's linear layers are split by tp, and so is what its profiling holds.
    assert M.vision_profile_bytes(info, 2048, tp=4) == per_image // 4


def test_qwen3_vl_is_profiled_with_a_video() -> None:
    """Qwen3-VL-30B-A3B under vLLM 0.11: "a budget of 153600 tokens, and profiled with 1 video items"."""
    info = load(CONFIGS / "Qwen__Qwen3-VL-30B-A3B-Instruct")
    assert (info.vision_item_tokens, info.vision_item_patches) == (153_600, 614_400)
    assert M.vision_profile_bytes(info, 2048, tp=4) == M.vision_profile_bytes(info, 153_600, tp=4) \
        == 614_400 * (3 * 1152 + 4304) * 2 // 4


def test_each_llama_cpp_slot_keeps_its_own_recurrent_state() -> None:
    """llama.cpp sizes the recurrent state for -np sequences: four slots of Qwen3.5-27B hold four states."""
    info = load(DENSE)
    state = fleet(node("n1", "fa", cls="RTX3090-24GB", count=1, mem=24135))
    req = m.PlanRequest(model=info.name, precisions=("q4_K_M",), tp=(1,), context=32768, parallel=4, all=True)
    c = P.plan(info, state, req).candidates[0]
    shape = M.kv_shape(info, "llama.cpp", 1)
    need = shape.bytes_for(32768) * 4
    assert need - 4 * shape.state == 4 * 32768 * shape.bytes_per_token
    assert not c.fits and f"needs {M.gib(need)} GiB of KV cache" in (c.reason or ""), c.reason
