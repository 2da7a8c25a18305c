"""``llmgw demo-model``: a GGUF that llama.cpp loads and serves, a checkpoint for vLLM, and a config.json the
planner sizes alike."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from llama import call, llama_server, llama_server_bin  # noqa: F401 - the fixture is used by name

from llmgw.cli.main import cli
from llmgw.engine.demomodel import CHAT_TEMPLATE, write_demo_model
from llmgw.errors import ConfigError
from llmgw.planner import candidates as planner
from llmgw.planner import memory, modelinfo

ROOT = Path(__file__).resolve().parent.parent
FLEET = str(ROOT / "examples" / "fleet.toml")
CPU_FLEET = str(ROOT / "examples" / "cpu.toml")
Q8 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32


def field(reader: gguf.GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


def test_the_gguf_states_the_architecture_it_was_asked_for(tmp_path: Path) -> None:
    made = write_demo_model(tmp_path / "tiny", layers=3, embd=96, heads=6, kv_heads=3, context=4096)
    assert made.gguf == tmp_path / "tiny" / "tiny-Q8_0.gguf"
    r = gguf.GGUFReader(made.gguf)
    assert field(r, "general.architecture") == "llama"
    assert field(r, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q8_0
    assert [field(r, f"llama.{k}") for k in ("context_length", "embedding_length", "block_count",
                                             "feed_forward_length", "attention.head_count",
                                             "attention.head_count_kv")] == [4096, 96, 3, 384, 6, 3]
    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type")
    assert isinstance(tokens, list) and isinstance(types, list) and len(tokens) == len(types) == made.vocab_size
    assert field(r, "tokenizer.ggml.model") == "llama"
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert (field(r, "tokenizer.ggml.bos_token_id"), field(r, "tokenizer.ggml.eos_token_id")) == (1, 2)
    byte_tokens = [t for t, k in zip(tokens, types, strict=True) if k == gguf.TokenType.BYTE]
    assert byte_tokens == [f"<0x{b:02X}>" for b in range(256)]
    assert len(set(tokens)) == len(tokens) and "▁hello" in tokens
    assert "<|im_start|>" in str(field(r, "tokenizer.chat_template"))

    shapes = {t.name: ([int(d) for d in t.shape], t.tensor_type) for t in r.tensors}
    vocab, kv = made.vocab_size, 3 * 96 // 6
    assert shapes["token_embd.weight"] == ([96, vocab], Q8)
    assert shapes["output.weight"] == ([96, vocab], Q8)
    assert shapes["output_norm.weight"] == ([96], F32)
    for i in range(3):
        assert shapes[f"blk.{i}.attn_q.weight"] == ([96, 96], Q8)
        assert shapes[f"blk.{i}.attn_k.weight"] == ([96, kv], Q8)
        assert shapes[f"blk.{i}.attn_v.weight"] == ([96, kv], Q8)
        assert shapes[f"blk.{i}.attn_output.weight"] == ([96, 96], Q8)
        assert shapes[f"blk.{i}.ffn_gate.weight"] == ([96, 384], Q8)
        assert shapes[f"blk.{i}.ffn_up.weight"] == ([96, 384], Q8)
        assert shapes[f"blk.{i}.ffn_down.weight"] == ([384, 96], Q8)
        assert shapes[f"blk.{i}.attn_norm.weight"] == ([96], F32)
        assert shapes[f"blk.{i}.ffn_norm.weight"] == ([96], F32)
    assert len(shapes) == 2 + 1 + 9 * 3
    assert sum(int(t.n_elements) for t in r.tensors) == made.params


def test_the_same_seed_writes_the_same_file(tmp_path: Path) -> None:
    a = write_demo_model(tmp_path / "a" / "m", seed=7).gguf.read_bytes()
    b = write_demo_model(tmp_path / "b" / "m", seed=7).gguf.read_bytes()
    c = write_demo_model(tmp_path / "c" / "m", seed=8).gguf.read_bytes()
    assert a == b != c


def test_the_planner_reads_the_same_model_and_names_the_file_written(tmp_path: Path) -> None:
    made = write_demo_model(tmp_path / "Org__demo")
    info = modelinfo.load_dir(made.gguf.parent)
    assert (info.name, info.model_type, info.num_layers, info.hidden_size, info.intermediate_size) == \
        ("Org/demo", "llama", 2, 64, 256)
    assert (info.num_attention_heads, info.num_kv_heads, info.head_dim) == (4, 2, 16)
    assert (info.vocab_size, info.max_position_embeddings) == (made.vocab_size, 2048)
    assert (info.params, info.params_source) == (made.params, "architecture")
    assert planner.gguf_file(info, memory.precision("q8_0")) == made.gguf.name == "demo-Q8_0.gguf"


def test_the_plan_offers_llama_cpp_at_q8_0_with_the_file_written(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    made = write_demo_model(tmp_path / "llmgw-demo")
    res = CliRunner().invoke(cli, ["ctl", "model", "plan", str(made.gguf.parent), "--fleet", FLEET,
                                   "--precision", "q8_0", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["params"] == made.params and data["candidates"]
    for c in data["candidates"]:
        assert (c["engine"], c["precision"], c["file"]) == ("llama.cpp", "q8_0", made.gguf.name)
        assert f"llama-server -m {made.gguf} -c 2048" in c["command"]  # the file the agent loads


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"embd": 50}, "pass e.g. --embd 32 or --embd 64"),
    ({"heads": 3}, "--heads 3 does not split --embd 64"),
    ({"heads": 4, "kv_heads": 3}, "pass one of 1, 2, 4"),
    ({"layers": 0}, "--layers 0 is outside 1..32"),
    ({"context": 16}, "--context 16 is outside"),
])
def test_a_model_llama_cpp_cannot_load_is_refused_with_what_to_pass(tmp_path: Path, kwargs: dict[str, Any],
                                                                    says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        write_demo_model(tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()


def test_cli_says_what_it_wrote_and_what_to_do_next(tmp_path: Path) -> None:
    d = tmp_path / "llmgw-demo"
    res = CliRunner().invoke(cli, ["demo-model", str(d), "--layers", "3", "--context", "1024"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].startswith(f"wrote {d / 'llmgw-demo-Q8_0.gguf'} (")
    assert "llama, 293K parameters, 3 layers, embedding 64, 4 heads / 2 KV heads" in lines[0]
    assert lines[0].endswith("context 1024")
    assert lines[1] == f"wrote {d / 'config.json'}"
    assert f"  llmgw ctl model plan {d} --fleet examples/fleet.toml   # or against a running control plane" in lines
    assert any(ln.startswith(f"  llama-server -m {d / 'llmgw-demo-Q8_0.gguf'} -c 1024 ") for ln in lines)


def test_cli_bad_embedding_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["demo-model", str(tmp_path / "m"), "--embd", "50"])
    assert res.exit_code == 1
    assert res.output == ("Error: --embd 50: Q8_0 stores rows in blocks of 32, so the embedding must be a multiple "
                          "of 32 from 32 to 2048; pass e.g. --embd 32 or --embd 64\n")


@pytest.mark.timeout(50 * 60)  # the first run on a machine builds llama-server (tests/llama.py)
def test_llama_server_loads_it_and_answers_a_chat(tmp_path: Path, llama_server_bin: Path) -> None:  # noqa: F811
    made = write_demo_model(tmp_path / "llmgw-demo")
    log = tmp_path / "llama-server.log"
    with llama_server(llama_server_bin, made.gguf, "-c", "512", "-np", "2", log=log) as url:
        status, reply = call(f"{url}/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 8})
        assert status == 200, reply
        assert reply["choices"][0]["message"]["role"] == "assistant"
        assert reply["usage"]["prompt_tokens"] > 0 and reply["usage"]["completion_tokens"] <= 8
        assert "prompt_per_second" in reply["timings"]
        status, tokens = call(f"{url}/tokenize", {"content": "hello world", "with_pieces": True})
        assert status == 200, tokens
        assert [t["piece"] for t in tokens["tokens"]] == [" hello", " world"]
        status, props = call(f"{url}/props")
        assert status == 200, props
        assert props["default_generation_settings"]["n_ctx"] == 256  # -c 512 over -np 2 slots


# --- the hf form: what vLLM loads ------------------------------------------------------------------


def safetensors(path: Path) -> tuple[dict[str, Any], bytes]:
    """The header (without __metadata__) and the tensor bytes of a .safetensors file."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    assert header.pop("__metadata__") == {"format": "pt"}
    return header, raw[8 + size:]


def bf16(data: bytes) -> np.ndarray:
    return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)


def test_the_hf_checkpoint_holds_the_tensors_its_config_states(tmp_path: Path) -> None:
    made = write_demo_model(tmp_path / "tiny", format="hf", layers=3, embd=192, heads=6, kv_heads=3, context=4096)
    d = tmp_path / "tiny"
    assert made.weights == d / "model.safetensors" and made.config == d / "config.json"
    assert made.files == (d / "tokenizer.json", d / "tokenizer_config.json", d / "generation_config.json")
    cfg = json.loads(made.config.read_text())
    assert (cfg["architectures"], cfg["torch_dtype"], cfg["tie_word_embeddings"]) == (["LlamaForCausalLM"], "bfloat16",
                                                                                      False)
    assert [cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                             "head_dim", "intermediate_size", "max_position_embeddings")] == [192, 3, 6, 3, 32, 768, 4096]
    assert cfg["head_dim"] % 32 == 0  # vLLM's CPU attention picks its kernel by it

    header, data = safetensors(made.weights)
    shapes = {name: t["shape"] for name, t in header.items()}
    vocab, q, kv, ffn = cfg["vocab_size"], 6 * 32, 3 * 32, 768
    assert vocab == made.vocab_size
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == [vocab, 192]
    assert shapes["model.norm.weight"] == [192]
    for i in range(3):
        at = f"model.layers.{i}"
        assert shapes[f"{at}.self_attn.q_proj.weight"] == [q, 192]
        assert shapes[f"{at}.self_attn.k_proj.weight"] == shapes[f"{at}.self_attn.v_proj.weight"] == [kv, 192]
        assert shapes[f"{at}.self_attn.o_proj.weight"] == [192, q]
        assert shapes[f"{at}.mlp.gate_proj.weight"] == shapes[f"{at}.mlp.up_proj.weight"] == [ffn, 192]
        assert shapes[f"{at}.mlp.down_proj.weight"] == [192, ffn]
        assert shapes[f"{at}.input_layernorm.weight"] == shapes[f"{at}.post_attention_layernorm.weight"] == [192]
    assert len(shapes) == 3 + 9 * 3
    assert {t["dtype"] for t in header.values()} == {"BF16"}

    # The tensors tile the data with no gap or overlap, each exactly its shape's bytes.
    spans = sorted(tuple(t["data_offsets"]) for t in header.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    for t in header.values():
        assert t["data_offsets"][1] - t["data_offsets"][0] == 2 * int(np.prod(t["shape"]))
    assert made.params == sum(int(np.prod(s)) for s in shapes.values()) == len(data) // 2

    def tensor(name: str) -> np.ndarray:
        a, b = header[name]["data_offsets"]
        return bf16(data[a:b])

    assert (tensor("model.norm.weight") == 1.0).all()
    w = tensor("model.layers.0.mlp.up_proj.weight")
    assert abs(float(w.mean())) < 0.002 and 0.018 < float(w.std()) < 0.022


def test_the_hf_tokenizer_round_trips_text_and_knows_the_chat_markers(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    made = write_demo_model(tmp_path / "m", format="hf")
    tok = Tokenizer.from_file(str(tmp_path / "m" / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == made.vocab_size
    for text in ["hello world", "The fleet plans 3 replicas.", "  two  spaces\nand a tab\t", "Ünïcödé 🙂 日本"]:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
    assert len(tok.encode(" hello").ids) == 1  # the demo words are whole tokens, not bytes
    cfg = json.loads(made.config.read_text())
    gen = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    tcfg = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert cfg["eos_token_id"] == gen["eos_token_id"] == im_end
    assert cfg["bos_token_id"] == gen["bos_token_id"] == tok.token_to_id("<|endoftext|>")
    assert (tcfg["eos_token"], tcfg["bos_token"], tcfg["chat_template"]) == ("<|im_end|>", None, CHAT_TEMPLATE)
    chat = tok.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n").ids
    assert chat[0] == im_start and chat.count(im_start) == 2 and chat.count(im_end) == 1


def test_the_hf_form_with_the_same_seed_writes_the_same_files(tmp_path: Path) -> None:
    def files(d: Path, seed: int) -> dict[str, bytes]:
        write_demo_model(d, format="hf", seed=seed)
        return {p.name: p.read_bytes() for p in sorted(d.iterdir())}

    a, b, c = files(tmp_path / "a" / "m", 7), files(tmp_path / "b" / "m", 7), files(tmp_path / "c" / "m", 8)
    assert sorted(a) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                         "tokenizer_config.json"]
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"] and a["tokenizer.json"] == c["tokenizer.json"]


def test_the_plan_offers_vllm_at_bf16_with_the_parameters_of_the_safetensors_header(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    made = write_demo_model(tmp_path / "llmgw-demo", format="hf")
    info = modelinfo.load_dir(made.weights.parent)
    assert (info.params, info.params_source, info.head_dim, info.torch_dtype) == (made.params, "safetensors-header",
                                                                                 32, "bfloat16")
    res = CliRunner().invoke(cli, ["ctl", "model", "plan", str(made.weights.parent), "--fleet", CPU_FLEET, "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert (data["params"], data["params_source"]) == (made.params, "safetensors-header")
    first = data["candidates"][0]
    assert (first["engine"], first["precision"], first["fits"], first["file"]) == ("vllm", "bf16", True, None)
    assert first["command"].startswith(f"vllm serve {made.weights.parent.resolve()} ")
    assert first["kv_bytes_per_token_per_gpu"] == 2 * 2 * 2 * 32 * 2  # layers x K and V x KV heads x head_dim x bf16


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"embd": 64}, "--heads 4 splits --embd 64 into heads of 16; vLLM's CPU attention has kernels for head sizes "
                   "32, 64, 96, 128, 160, 192, 224, 256 only: pass --heads 1 or 2, or --embd 128"),
    ({"embd": 96, "heads": 4}, "into heads of 24"),
    ({"embd": 100}, "--embd 100: vLLM's CPU attention needs heads of a multiple of 32"),
    ({"embd": 128, "heads": 3}, "--heads 3 splits --embd 128 into unequal heads"),
    ({"kv_heads": 3}, "pass one of 1, 2, 4"),
])
def test_an_hf_model_vllm_cannot_run_on_a_cpu_is_refused_with_what_to_pass(tmp_path: Path, kwargs: dict[str, Any],
                                                                           says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        write_demo_model(tmp_path / "m", format="hf", **kwargs)
    assert not (tmp_path / "m").exists()


def test_cli_hf_says_what_it_wrote_and_how_vllm_serves_it_on_a_cpu(tmp_path: Path) -> None:
    d = tmp_path / "llmgw-demo"
    res = CliRunner().invoke(cli, ["demo-model", str(d), "--format", "hf", "--context", "1024"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].startswith(f"wrote {d / 'model.safetensors'} (")
    assert "bf16): llama, 782K parameters, 2 layers, embedding 128, 4 heads / 2 KV heads, FFN 512" in lines[0]
    assert lines[0].endswith("context 1024")
    assert lines[1:5] == [f"wrote {d / f}" for f in ("config.json", "tokenizer.json", "tokenizer_config.json",
                                                      "generation_config.json")]
    assert f"  llmgw ctl model plan {d} --fleet examples/cpu.toml   # or against a running control plane" in lines
    assert any(ln.startswith(f"  vllm serve {d} --dtype float32 --enforce-eager --max-model-len 1024 "
                             "--kv-cache-memory-bytes 64M ") for ln in lines)


# --- a random LoRA for it -----------------------------------------------------------------------------


def _bf16_values(raw: bytes) -> np.ndarray:
    return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)


def _safetensors(path: Path) -> tuple[dict[str, Any], bytes]:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def test_the_gguf_adapter_is_laid_out_as_llama_cpp_loads_one(tmp_path: Path) -> None:
    from llmgw.engine.demolora import write_demo_lora

    model = write_demo_model(tmp_path / "tiny")  # embedding 64, 4 heads of 16, 2 KV heads, FFN 256
    made = write_demo_lora(tmp_path / "tiny", "sql", rank=8, alpha=16)
    assert made.path == tmp_path / "tiny" / "loras" / "sql.gguf"
    r = gguf.GGUFReader(made.path)
    assert [field(r, k) for k in ("general.architecture", "general.type", "adapter.type")] == ["llama", "adapter", "lora"]
    assert field(r, "adapter.lora.alpha") == 16.0
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 2 * 7 * model.layers
    # ggml's ne: lora_a [in, r], lora_b [r, out]; llama.cpp checks them against the base's [in, out].
    expect = {"attn_q": (64, 64), "attn_k": (64, 32), "attn_v": (64, 32), "attn_output": (64, 64),
              "ffn_gate": (64, 256), "ffn_up": (64, 256), "ffn_down": (256, 64)}
    for module, (n_in, n_out) in expect.items():
        a, b = tensors[f"blk.1.{module}.weight.lora_a"], tensors[f"blk.1.{module}.weight.lora_b"]
        assert ([int(d) for d in a.shape], [int(d) for d in b.shape]) == ([n_in, 8], [8, n_out]), module
        assert a.tensor_type == b.tensor_type == gguf.GGMLQuantizationType.F16
    # Not PEFT's fresh B = 0, which would change nothing: about the base weights' own spread once scaled.
    b = np.asarray(tensors["blk.0.attn_q.weight.lora_b"].data, dtype=np.float32)
    a = np.asarray(tensors["blk.0.attn_q.weight.lora_a"].data, dtype=np.float32)
    delta = 16 / 8 * b @ a
    assert 0.01 < float(delta.std()) < 0.04


def test_the_peft_adapter_is_laid_out_as_vllm_loads_one(tmp_path: Path) -> None:
    from llmgw.engine.demolora import write_demo_lora

    write_demo_model(tmp_path / "hf", format="hf")  # embedding 128, 4 heads of 32, 2 KV heads, FFN 512
    made = write_demo_lora(tmp_path / "hf", "chat", format="hf", rank=16, alpha=32, targets=("q_proj", "v_proj"))
    assert made.path == tmp_path / "hf" / "loras" / "chat"
    cfg = json.loads((made.path / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["target_modules"]) == ("LORA", 16, 32, ["q_proj", "v_proj"])
    assert cfg["base_model_name_or_path"] == str((tmp_path / "hf").resolve()) and cfg["bias"] == "none"
    header, data = _safetensors(made.path / "adapter_model.safetensors")
    header.pop("__metadata__")
    at = "base_model.model.model.layers"
    assert set(header) == {f"{at}.{i}.self_attn.{mod}.lora_{ab}.weight" for i in range(2)
                           for mod in ("q_proj", "v_proj") for ab in "AB"}
    # PEFT's order: lora_A [r, in], lora_B [out, r].
    assert header[f"{at}.0.self_attn.q_proj.lora_A.weight"]["shape"] == [16, 128]
    assert header[f"{at}.0.self_attn.v_proj.lora_B.weight"]["shape"] == [64, 16]
    assert {e["dtype"] for e in header.values()} == {"BF16"}
    lo, hi = header[f"{at}.1.self_attn.v_proj.lora_B.weight"]["data_offsets"]
    assert np.count_nonzero(_bf16_values(data[lo:hi])) == 64 * 16


@pytest.mark.parametrize("fmt", ["gguf", "hf"])
@pytest.mark.parametrize("rank", [8, 64])
def test_the_planner_reads_back_the_adapter_and_fits_it_to_its_model(tmp_path: Path, fmt: str, rank: int) -> None:
    from llmgw.engine.demolora import write_demo_lora
    from llmgw.planner import adapters

    model = write_demo_model(tmp_path / "m", format=fmt)  # type: ignore[arg-type]
    made = write_demo_lora(tmp_path / "m", "a1", format=fmt, rank=rank, alpha=2 * rank)  # type: ignore[arg-type]
    facts = adapters.read(made.path)
    assert (facts.format, facts.rank, facts.alpha, facts.layers) == ({"gguf": "gguf", "hf": "peft"}[fmt], rank,
                                                                      2.0 * rank, 2)
    assert facts.target_modules == tuple(sorted(made.targets))
    h, ffn, kv = model.embd, model.ffn, model.kv_heads * model.embd // model.heads
    per_layer = 2 * h + 2 * (h + kv) + 2 * h + 3 * (h + ffn)  # in + out of q, k, v, o, gate, up, down
    assert facts.size_bytes == made.tensor_bytes == 2 * rank * per_layer * model.layers  # 16-bit either way
    assert adapters.check_base(facts, modelinfo.load_dir(tmp_path / "m")) is None


def test_an_adapter_of_one_demo_model_is_refused_on_another(tmp_path: Path) -> None:
    from llmgw.engine.demolora import write_demo_lora
    from llmgw.planner import adapters

    write_demo_model(tmp_path / "small")
    write_demo_model(tmp_path / "wide", embd=128)
    made = write_demo_lora(tmp_path / "small", "a1")
    why = adapters.check_base(adapters.read(made.path), modelinfo.load_dir(tmp_path / "wide"))
    assert why is not None and "an adapter of another model" in why


def test_two_names_are_two_adapters_and_one_name_the_same_again(tmp_path: Path) -> None:
    from llmgw.engine.demolora import write_demo_lora

    write_demo_model(tmp_path / "m")
    one, other = write_demo_lora(tmp_path / "m", "a1"), write_demo_lora(tmp_path / "m", "a2")
    first = one.path.read_bytes()
    assert write_demo_lora(tmp_path / "m", "a1").path.read_bytes() == first
    assert other.path.read_bytes() != first


def test_cli_writes_the_model_and_its_adapters_and_says_how_to_declare_them(tmp_path: Path) -> None:
    d = tmp_path / "llmgw-demo"
    res = CliRunner().invoke(cli, ["demo-model", str(d), "--lora", "sql", "--lora", "chat", "--lora-rank", "16"])
    assert res.exit_code == 0, res.output
    assert (d / "llmgw-demo-Q8_0.gguf").is_file() and (d / "config.json").is_file()
    assert f"wrote {d}/loras/sql.gguf (GGUF adapter, F16, 88 KiB of tensors): LoRA rank 16, alpha 16" in res.output
    assert f"llmgw ctl adapter add chat {d}/loras/chat.gguf --base llmgw-demo" in res.output
    assert f"--lora {d}/loras/sql.gguf --lora {d}/loras/chat.gguf" in res.output
    # Into the model already there: the hf form's adapters are PEFT, for vLLM.
    hf = tmp_path / "hf"
    assert CliRunner().invoke(cli, ["demo-model", str(hf), "--format", "hf"]).exit_code == 0
    res = CliRunner().invoke(cli, ["demo-model", str(hf), "--lora", "a1", "--lora-targets", "q_proj,attn_v"])
    assert res.exit_code == 0, res.output
    assert f"{hf} holds the hf demo model already" in res.output and (hf / "loras" / "a1" / "adapter_config.json").is_file()
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve" in res.output and "--max-lora-rank 8" in res.output


@pytest.mark.parametrize(("args", "words"), [
    (["--lora", "a/b"], ["--lora 'a/b'", "letters, digits"]),
    (["--lora", "a", "--lora-rank", "0"], ["--lora-rank 0", "1..512"]),
    (["--lora", "a", "--lora-alpha", "nan"], ["--lora-alpha nan"]),
    (["--lora", "a", "--lora-targets", "lm_head"], ["--lora-targets 'lm_head'", "q_proj"]),
])
def test_cli_a_bad_adapter_is_an_error_before_anything_is_written(tmp_path: Path, args: list[str],
                                                                  words: list[str]) -> None:
    res = CliRunner().invoke(cli, ["demo-model", str(tmp_path / "m"), *args])
    assert res.exit_code == 1 and res.output.startswith("Error: ") and all(w in res.output for w in words), res.output
    assert not (tmp_path / "m").exists()


def test_cli_an_adapter_for_the_other_engines_form_of_the_model_is_refused(tmp_path: Path) -> None:
    assert CliRunner().invoke(cli, ["demo-model", str(tmp_path / "g")]).exit_code == 0
    res = CliRunner().invoke(cli, ["demo-model", str(tmp_path / "g"), "--lora", "a", "--format", "hf"])
    assert res.exit_code == 1 and "holds the gguf demo model" in res.output and "--format gguf" in res.output
    assert not (tmp_path / "g" / "loras").exists()
