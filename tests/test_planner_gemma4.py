"""Gemma 4: full-attention layers of their own shape, a dense MLP beside the experts, KV sharing, PLE.

Before the planner read these fields it sized Gemma-4-26B-A4B's full-attention layers as its sliding
ones (8 KV heads of 256 instead of 2 of 512), dropped the dense MLP that runs beside the experts in
every layer and planned no expert as active (``top_k_experts``, not ``num_experts_per_tok``).
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from llmgw.planner import memory as M
from llmgw.planner import modelinfo

GIB = 1024**3
MOE = Path(__file__).resolve().parent / "data" / "calibration" / "google__gemma-4-26B-A4B"


def config() -> dict:
    return json.loads((MOE / "config.json").read_text())


def test_full_attention_layers_keep_their_own_heads_and_sliding_ones_their_window() -> None:
    info = modelinfo.load_dir(MOE)
    text = config()["text_config"]
    full = [i for i, t in enumerate(text["layer_types"]) if t == "full_attention"]
    assert len(full) == 5 and set(info.sliding_layers).isdisjoint(full)
    shape = M.kv_shape(info, "vllm", 1)
    # vLLM stores K and V for k_eq_v layers too (the K weights loaded into both slots).
    full_bytes = 2 * text["num_global_key_value_heads"] * text["global_head_dim"] * 2
    sliding_bytes = 2 * text["num_key_value_heads"] * text["head_dim"] * 2
    assert (shape.per_layer, shape.window_per_layer) == (full_bytes, sliding_bytes) == (4096, 8192)
    window = text["sliding_window"] + M.VLLM_BATCHED_TOKENS
    assert shape.bytes_for(32768) == 5 * full_bytes * 32768 + 25 * sliding_bytes * window
    assert shape.max_context(shape.bytes_for(100_000)) == 100_000
    # Read as its sliding layers' shape, its full 262,144-token context held 1.7 times as much.
    uniform = msgspec.structs.replace(info, full_head_dim=0, full_kv_heads=0)
    assert M.kv_shape(uniform, "vllm", 1).bytes_for(262144) > 1.7 * shape.bytes_for(262144)


def test_the_weights_count_the_dense_mlp_beside_the_experts() -> None:
    info = modelinfo.load_dir(MOE)
    # vLLM 0.20.2 on an H200 (tests/data/vllm_observed.jsonl): "Checkpoint size: 48.07 GiB" of bf16.
    assert info.params == pytest.approx(48.07 * GIB / 2, rel=0.01)
    assert info.dense_and_moe and info.experts_per_token == 8
    text = config()["text_config"]
    without = msgspec.structs.replace(info, dense_and_moe=False, params=0)
    dense = text["num_hidden_layers"] * 3 * text["hidden_size"] * text["intermediate_size"]
    assert M.architecture_params(msgspec.structs.replace(info, params=0)) - M.architecture_params(without) == dense


def test_kv_sharing_layers_hold_no_cache_and_ple_is_weights() -> None:
    text = {**config()["text_config"], "num_kv_shared_layers": 6, "hidden_size_per_layer_input": 256}
    info = modelinfo.from_config(text, name="x/y", source="x/y")
    base = modelinfo.from_config(config()["text_config"], name="x/y", source="x/y")
    shared = [t for t in text["layer_types"][-6:]]
    full_gone, sliding_gone = shared.count("full_attention"), shared.count("sliding_attention")
    a, b = M.kv_shape(info, "vllm", 1), M.kv_shape(base, "vllm", 1)
    assert (b.full_layers - a.full_layers, b.window_layers - a.window_layers) == (full_gone, sliding_gone)
    # Per-layer embeddings: vocab x layers x 256, the model's projection into them, and per layer a gate
    # and a projection back.
    layers, h, ple = text["num_hidden_layers"], text["hidden_size"], 256
    extra = text["vocab_size_per_layer_input"] * layers * ple + h * layers * ple + layers * 2 * h * ple
    assert M.architecture_params(info) - M.architecture_params(base) == extra


def test_a_config_that_shares_every_layers_cache_is_refused() -> None:
    text = {**config()["text_config"], "num_kv_shared_layers": 30}
    with pytest.raises(modelinfo.ModelError, match="at least one layer must keep its own"):
        modelinfo.from_config(text, name="x/y", source="x/y")
