"""``llmgw ctl model plan`` in what-if mode (--fleet, no NATS): what the operator sees, and the JSON contract."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmgw.cli.main import cli
from llmgw.config import Settings
from llmgw.ctl import plan_remotely
from llmgw.errors import ConnectError
from llmgw.messages import PlanRequest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
MODELS = EXAMPLES / "models"
FLEET = str(EXAMPLES / "fleet.toml")

CONTRACT = {"gpu_class", "fabric", "nodes", "tp", "pp", "precision", "engine", "quantization", "fits", "reason",
            "weights_gib_per_gpu", "kv_bytes_per_token_per_gpu", "kv_gib_per_gpu", "kv_tokens", "max_context",
            "replicas_now", "command"}


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("LLMGW_MODELS_DIR", raising=False)


def plan(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["ctl", "model", "plan", *args], env=env)
    return result.exit_code, result.output


def test_json_contract() -> None:
    code, out = plan("Qwen/Qwen2.5-Coder-32B-Instruct", "--models-dir", str(MODELS), "--fleet", FLEET, "--json")
    assert code == 0, out
    data = json.loads(out)
    assert (data["model"], data["params"]) == ("Qwen/Qwen2.5-Coder-32B-Instruct", 32_763_876_352)
    assert data["candidates"] and all(c["fits"] for c in data["candidates"])
    for c in data["candidates"]:
        assert CONTRACT <= set(c), CONTRACT - set(c)
        assert c["engine"] in ("vllm", "llama.cpp")
        if c["engine"] == "llama.cpp":
            assert c["file"].endswith(".gguf") and c["file_gib"] > 0 and c["quantization"] is None
        else:
            assert c["file"] is None and c["file_gib"] is None
    fp8 = [c for c in data["candidates"] if c["precision"] == "fp8" and c["gpu_class"] == "H100-80GB" and c["tp"] == 1]
    assert len(fp8) == 1 and fp8[0]["quantization"] == "fp8" and "--quantization fp8" in fp8[0]["command"]


def test_all_lists_what_does_not_fit_with_reasons() -> None:
    code, out = plan(str(MODELS / "meta-llama__Llama-3.3-70B-Instruct"), "--fleet", FLEET, "--precision", "bf16",
                     "--context", "8192", "--all", "--json", "--engine-version", "0.11.0")
    assert code == 0, out
    cands = json.loads(out)["candidates"]
    misfits = [c for c in cands if not c["fits"]]
    assert misfits and all(c["reason"] for c in misfits) and all(c["replicas_now"] == 0 for c in misfits)
    assert cands[: len(cands) - len(misfits)] == [c for c in cands if c["fits"]]  # fitting ones first
    h100 = {c["tp"]: c["fits"] for c in cands if c["gpu_class"] == "H100-80GB"}
    # At 0.9, two H100s hold the bf16 weights but vLLM 0.11's profiling peak (~4.8 GiB for a
    # 128k vocabulary) leaves ~4,400 tokens of KV: 8,192 needs 0.95 (see the 0.95 test).
    assert h100 == {1: False, 2: False, 4: True, 8: True}
    # vLLM 0.29's sampler pass is a third of that and its default utilization 0.92: two H100s hold 8,192.
    code, out = plan(str(MODELS / "meta-llama__Llama-3.3-70B-Instruct"), "--fleet", FLEET, "--precision", "bf16",
                     "--context", "8192", "--all", "--json", "--engine-version", "0.29.0")
    newer = {c["tp"]: c["fits"] for c in json.loads(out)["candidates"] if c["gpu_class"] == "H100-80GB"}
    assert code == 0 and newer == {1: False, 2: True, 4: True, 8: True}


def test_table_for_people() -> None:
    code, out = plan(str(MODELS / "google__gemma-2-9b-it"), "--fleet", FLEET, "--tp", "1", "--precision", "bf16",
                     "--precision", "q8_0")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == "google/gemma-2-9b-it: 9.24B parameters (safetensors-index); 63 healthy GPUs in the fleet"
    assert lines[1] == "engine: vLLM 0.31.0 (profile vllm 0.29+; no agent reports one: the newest profile)"
    assert any("H100-80GB" in line and "bf16" in line and "vllm" in line for line in lines)
    assert (f"vllm serve {MODELS / 'google__gemma-2-9b-it'} --tensor-parallel-size 1 --max-num-seqs 1024 "
            "--max-model-len 8192 --gpu-memory-utilization 0.92 --host 0.0.0.0 --port 8000 "
            "--served-model-name gemma-2-9b-it") in out
    # The file where the agent looks for it: in the model's directory, not wherever the command is typed.
    assert (f"llama-server -m {MODELS / 'google__gemma-2-9b-it' / 'gemma-2-9b-it-Q8_0.gguf'} -c 8192 -np 1 -ngl 999 "
            "--host 0.0.0.0 --port 8000 --alias gemma-2-9b-it   # download gemma-2-9b-it-Q8_0.gguf") in out
    assert "declaration for candidate 1" in out and '"engine":"vllm"' in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tp", "3"], "Error: --tp 3 does not split the 64 attention heads and 8 KV heads"),
        (["--gpu-memory-utilization", "1.5"], "Error: --gpu-memory-utilization is the fraction"),
        (["--precision", "int2"], "Error: unknown precision 'int2'"),
        (["--params", "lots"], "Invalid value for '--params'"),
        (["--context", "999999"], "Error: --context 999999 is outside what"),
    ],
)
def test_mistakes_print_error_and_exit_1(args: list[str], message: str) -> None:
    code, out = plan(str(MODELS / "meta-llama__Llama-3.3-70B-Instruct"), "--fleet", FLEET, *args)
    assert code != 0 and message in out and "Traceback" not in out


def test_unknown_repo_offline_says_how_to_supply_it() -> None:
    code, out = plan("nobody/nothing-7B", "--fleet", FLEET)
    assert code == 1
    assert out.startswith("Error: nobody/nothing-7B: no config.json in the Hugging Face cache")
    assert "pass a local directory" in out


def test_missing_fleet_file() -> None:
    code, out = plan(str(MODELS / "Qwen__Qwen3-8B"), "--fleet", "/no/such/fleet.toml")
    assert code == 1 and "Error: /no/such/fleet.toml: does not exist" in out


def test_params_override_for_a_model_without_index() -> None:
    code, out = plan(str(MODELS / "deepseek-ai__DeepSeek-V3"), "--fleet", FLEET, "--params", "671B", "--json")
    assert code == 0, out
    data = json.loads(out)
    assert data["params"] == 671_000_000_000 and data["params_source"] == "--params"
    multi = [c for c in data["candidates"] if c["pp"] > 1]
    assert multi and all(c["fabric"] in ("ib-a", "ib-b") and c["gpu_class"] == "H100-80GB" for c in multi)
    assert all("--quantization" not in c["command"] for c in multi)  # the checkpoint already is fp8


def test_nothing_fits_explains(tmp_path: Path) -> None:
    small = tmp_path / "small.toml"
    small.write_text('[[nodes]]\nname = "t4"\nfabric = "eth"\ngpu_class = "T4-16GB"\ngpu_count = 1\ngpu_memory_mib = 15360\n')
    code, out = plan(str(MODELS / "meta-llama__Llama-3.3-70B-Instruct"), "--fleet", str(small))
    assert code == 0
    assert "note: nothing fits: the lightest split (q4_K_M, tp=1, pp=1 on T4-16GB)" in out



async def test_no_nats_suggests_what_if_mode() -> None:
    # Called below the click layer so that a short connect timeout keeps the test fast.
    with pytest.raises(ConnectError, match=r"^cannot reach NATS at nats://127.0.0.1:\d+; .*--fleet FILE$"):
        await plan_remotely(Settings(nats_url=f"nats://127.0.0.1:{_free_port()}", connect_timeout_s=0.1),
                            PlanRequest(model="Qwen/Qwen3-8B"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
