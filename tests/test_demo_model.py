"""``llmgw demo-model``: a GGUF that llama.cpp loads and serves, and a config.json the planner sizes alike."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import pytest
from click.testing import CliRunner
from llama import call, llama_server, llama_server_bin  # noqa: F401 - the fixture is used by name

from llmgw.cli.main import cli
from llmgw.engine.demomodel import write_demo_model
from llmgw.errors import ConfigError
from llmgw.planner import candidates as planner
from llmgw.planner import memory, modelinfo

ROOT = Path(__file__).resolve().parent.parent
FLEET = str(ROOT / "examples" / "fleet.toml")
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
