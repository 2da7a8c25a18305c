"""Reading a model: config.json, parameter counts, the HF cache offline, and clear errors. No network."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from llmgw.errors import ModelError
from llmgw.planner import memory as M
from llmgw.planner import modelinfo

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "examples" / "models"


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every test here is offline, with an empty HF cache unless it builds one."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.delenv("LLMGW_MODELS_DIR", raising=False)


@pytest.mark.parametrize(
    ("dirname", "params", "source", "fields"),
    [
        ("Qwen__Qwen2.5-14B-Instruct", 29540067328 // 2, "safetensors-index",
         {"num_layers": 48, "num_kv_heads": 8, "head_dim": 128, "attention_bias": True, "max_position_embeddings": 32768}),
        ("Qwen__Qwen3-8B", 16381470720 // 2, "safetensors-index", {"head_dim": 128, "attention_bias": False}),
        ("google__gemma-2-9b-it", 18483411968 // 2, "safetensors-index",
         {"head_dim": 256, "tie_word_embeddings": True, "sliding_window": 4096}),
        ("meta-llama__Llama-3.3-70B-Instruct", 141107412992 // 2, "safetensors-index",
         {"num_layers": 80, "num_attention_heads": 64, "num_kv_heads": 8, "max_position_embeddings": 131072}),
        ("mistralai__Mixtral-8x7B-Instruct-v0.1", 93405585408 // 2, "safetensors-index",
         {"num_experts": 8, "experts_per_token": 2, "moe_intermediate_size": 14336, "sliding_window": None}),
        ("deepseek-ai__DeepSeek-V3", None, "architecture",
         {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_experts": 256, "shared_experts": 1,
          "first_dense_layers": 3, "quantization": "fp8"}),
    ],
)
def test_example_models(dirname: str, params: int | None, source: str, fields: dict[str, object]) -> None:
    info = modelinfo.load(str(MODELS / dirname))
    assert info.name == dirname.replace("__", "/")
    assert info.params_source == source
    if params is not None:
        assert info.params == params
    for k, v in fields.items():
        assert getattr(info, k) == v, k


def test_architecture_agrees_with_every_index() -> None:
    """The architecture fallback counts what the checkpoints hold (within 0.1%)."""
    for d in MODELS.iterdir():
        info = modelinfo.load(str(d))
        if info.params_source == "safetensors-index":
            assert M.architecture_params(info) == pytest.approx(info.params, rel=1e-3), d.name


def test_params_override_wins(tmp_path: Path) -> None:
    info = modelinfo.load(str(MODELS / "deepseek-ai__DeepSeek-V3"), params=modelinfo.parse_params("671B"))
    assert (info.params, info.params_source) == (671_000_000_000, "--params")


@pytest.mark.parametrize(("text", "n"), [("70.6B", 70_600_000_000), ("7e9", 7_000_000_000), ("560M", 560_000_000),
                                         ("8_030_261_248", 8_030_261_248)])
def test_parse_params(text: str, n: int) -> None:
    assert modelinfo.parse_params(text) == n


@pytest.mark.parametrize("text", ["lots", "-3B", "0"])
def test_parse_params_refuses_nonsense(text: str) -> None:
    with pytest.raises(ModelError, match="--params"):
        modelinfo.parse_params(text)


def _hf_cache(home: Path, repo: str, files: dict[str, Path]) -> None:
    """The layout huggingface_hub writes: refs/main names a snapshot holding the files."""
    base = home / "hub" / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, src in files.items():
        shutil.copy(src, snap / name)


def test_repo_id_resolves_offline_from_the_hf_cache(tmp_path: Path) -> None:
    src = MODELS / "Qwen__Qwen2.5-14B-Instruct"
    _hf_cache(tmp_path / "hf-home", "Qwen/Qwen2.5-14B-Instruct",
              {"config.json": src / "config.json", "model.safetensors.index.json": src / "model.safetensors.index.json"})
    info = modelinfo.load("Qwen/Qwen2.5-14B-Instruct")
    assert (info.name, info.source, info.params, info.params_source) == (
        "Qwen/Qwen2.5-14B-Instruct", "Qwen/Qwen2.5-14B-Instruct", 14_770_033_664, "safetensors-index")


def test_repo_id_in_cache_without_index_falls_back_to_architecture(tmp_path: Path) -> None:
    _hf_cache(tmp_path / "hf-home", "meta-llama/Llama-3.1-8B-Instruct",
              {"config.json": MODELS / "meta-llama__Llama-3.1-8B-Instruct" / "config.json"})
    info = modelinfo.load("meta-llama/Llama-3.1-8B-Instruct")
    assert info.params_source == "architecture" and info.params == 8_030_261_248


def test_offline_without_cache_names_what_is_missing() -> None:
    with pytest.raises(ModelError, match=r"no config.json in the Hugging Face cache .*HF_HUB_OFFLINE=1.*local directory"):
        modelinfo.load("Qwen/Qwen2.5-Coder-32B-Instruct")


def test_models_dir_shorthand(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_MODELS_DIR", str(MODELS))
    info = modelinfo.load("Qwen/Qwen2.5-Coder-32B-Instruct")
    assert (info.source, info.params) == ("Qwen/Qwen2.5-Coder-32B-Instruct", 65527752704 // 2)


def test_not_a_path_nor_a_repo_id() -> None:
    with pytest.raises(ModelError, match="neither a directory with a config.json nor a Hugging Face repo id"):
        modelinfo.load("./no/such/dir/here")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="has no config.json"):
        modelinfo.load(str(tmp_path))


def test_config_missing_fields_names_them(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    with pytest.raises(ModelError, match="lacks num_hidden_layers, num_attention_heads, vocab_size, max_position_embeddings, intermediate_size"):
        modelinfo.load(str(tmp_path))


def test_config_not_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ModelError, match="cannot be read as JSON"):
        modelinfo.load(str(tmp_path))


def _safetensors(path: Path, tensors: dict[str, list[int]]) -> None:
    header: dict[str, Any] = {name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]} for name, shape in tensors.items()}
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_params_from_safetensors_headers(tmp_path: Path) -> None:
    shutil.copy(MODELS / "meta-llama__Llama-3.1-8B-Instruct" / "config.json", tmp_path / "config.json")
    _safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": [1000, 4096], "b": [4096]})
    _safetensors(tmp_path / "model-00002-of-00002.safetensors", {"c": [10, 10, 10]})
    info = modelinfo.load(str(tmp_path))
    assert (info.params, info.params_source) == (1000 * 4096 + 4096 + 1000, "safetensors-header")


def test_quantized_checkpoint_counts_params_from_architecture(tmp_path: Path) -> None:
    cfg = json.loads((MODELS / "Qwen__Qwen2.5-14B-Instruct" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 9_000_000_000}}))
    info = modelinfo.load(str(tmp_path))
    assert info.quantization == "awq" and info.params_source == "architecture"
    assert info.params == pytest.approx(14_770_033_664, rel=1e-3)  # not 9e9 / 2: packed bytes are not parameters


def test_unsupported_quantization_is_refused(tmp_path: Path) -> None:
    cfg = json.loads((MODELS / "Qwen__Qwen3-8B" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "hqq"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="hqq checkpoint, which the planner cannot size; it sizes compressed-tensors"):
        modelinfo.load(str(tmp_path))


def test_text_config_of_a_multimodal_wrapper(tmp_path: Path) -> None:
    inner = json.loads((MODELS / "meta-llama__Llama-3.1-8B-Instruct" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": inner}))
    info = modelinfo.load(str(tmp_path))
    assert (info.num_layers, info.num_kv_heads, info.params_source) == (32, 8, "architecture")


def test_zero_heads_is_refused_not_divided_by(tmp_path: Path) -> None:
    cfg = json.loads((MODELS / "Qwen__Qwen3-8B" / "config.json").read_text())
    cfg["num_attention_heads"] = 0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="lacks num_attention_heads"):
        modelinfo.load(str(tmp_path))
