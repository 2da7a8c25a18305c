"""One engine command line: what ``ctl model plan`` prints is what the agent runs.

The plan prints ``engine_argv`` of each candidate's spec with what only a node knows written
one fixed way (llmgw/engine/argv.py, "what only a node knows"): the programs as installed on
PATH, port 8000 on every interface, a GGUF where a node without a copy finds it, and over
several nodes Ray on 6379 with the head as HEAD. Here an agent with other programs, ports and
addresses builds its argvs from ``candidate.spec(name)``; put back those parts only, they are
the printed lines.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner

from llmgw import messages as m
from llmgw.agent.runs import EngineConfig, EngineRun
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.engine.argv import default_commands, engine_argv, parse_engine_cmds
from llmgw.planner import candidates as P

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_planner_math import EXAMPLES, LLAMA8, MODELS, fleet, model, node  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
AT = datetime(2026, 1, 1, tzinfo=UTC)

# The agent's node: its own programs and addresses (ports are whatever is free when it starts).
NODE_CMDS = parse_engine_cmds(["vllm=/opt/vllm/bin/vllm serve", "llama.cpp=/opt/llama.cpp/bin/llama-server",
                               "ray=/opt/vllm/bin/ray"])
PRINTED_PROGRAMS = {"vllm": ["vllm", "serve"], "llama.cpp": ["llama-server"], "ray": ["ray"]}


def test_an_fp16_plan_of_a_bf16_checkpoint_runs_as_fp16() -> None:
    """Before: the plan printed --dtype float16 and the agent ran the checkpoint's bf16."""
    info = model(LLAMA8)
    assert info.torch_dtype == "bfloat16"
    reply = P.plan(info, fleet(node("n1", "fa", count=1)), m.PlanRequest(model=info.name, precisions=("fp16",)))
    c = reply.candidates[0]
    assert "--dtype float16" in c.command
    argv = engine_argv(c.spec("l8"), 8000, "0.0.0.0", default_commands(), simulate=False)
    assert argv[argv.index("--dtype") + 1] == "float16"


def test_a_declaration_written_before_dtype_runs_the_checkpoints_own() -> None:
    line = next(ln for ln in (DATA / "events_v1.jsonl").read_text().splitlines() if '"ModelDeclared"' in ln)
    old = m.CONTROL_DECODER.decode(line.encode())
    assert isinstance(old, m.ModelDeclared) and old.spec.dtype == "auto"
    assert "--dtype" not in engine_argv(old.spec, 1, "h", default_commands(), simulate=False)
    bad = json.loads(line)
    bad["spec"]["dtype"] = "half"  # vLLM's alias; a spec names the one spelling
    with pytest.raises(msgspec.ValidationError, match="dtype"):
        m.CONTROL_DECODER.decode(json.dumps(bad).encode())


# --- every candidate of a set of plans ------------------------------------------------------------------


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Org__Name folders: the example models, an fp16 checkpoint, and pre-quantized ones (config alone)."""
    d = tmp_path_factory.mktemp("models")
    for src in [*MODELS.iterdir(), DATA / "calibration" / "Qwen__Qwen2.5-1.5B-Instruct"]:
        (d / src.name).symlink_to(src)
    for name in ("TheBloke__Llama-2-13B-chat-GPTQ__gptq-8bit-64g-actorder_True", "amd__Llama-3.1-8B-Instruct-FP8-KV"):
        folder = d / name.split("__gptq")[0]
        folder.mkdir()
        shutil.copy(DATA / "quantized" / f"{name}.json", folder / "config.json")
    return d


@pytest.fixture(scope="module")
def fleet_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example fleet and a 24 GB card, where CUDA graphs crowd the cache out (eager mode)."""
    path = tmp_path_factory.mktemp("fleet") / "fleet.toml"
    path.write_text((EXAMPLES / "fleet.toml").read_text() + "\n" + node("rtx-01", "eth", cls="RTX3090-24GB", count=1,
                                                                        mem=24135))
    return path


PLANS = {
    "dense bf16 checkpoint: its own, fp16, fp8 and the GGUFs": ["meta-llama/Llama-3.1-8B-Instruct", "--all"],
    "fp16 of a bf16 checkpoint": ["meta-llama/Llama-3.1-8B-Instruct", "--precision", "fp16", "--all"],
    "bf16 and fp16 of an fp16 checkpoint": ["Qwen/Qwen2.5-1.5B-Instruct", "--precision", "bf16", "--precision", "fp16"],
    "MoE": ["mistralai/Mixtral-8x7B-Instruct-v0.1"],
    "fp8 checkpoint over several nodes": ["deepseek-ai/DeepSeek-V3", "--params", "671B"],
    "pp 2 of tp 2, KV fp8": ["meta-llama/Llama-3.3-70B-Instruct", "--precision", "bf16", "--tp", "2", "--all",
                             "--kv-cache-dtype", "fp8"],
    "GPTQ checkpoint": ["TheBloke/Llama-2-13B-chat-GPTQ"],
    "checkpoint with an fp8 KV scheme": ["amd/Llama-3.1-8B-Instruct-FP8-KV"],
    "max-num-seqs and KV fp8 asked": ["Qwen/Qwen3-8B", "--max-num-seqs", "64", "--kv-cache-dtype", "fp8"],
    "llama.cpp slots": ["Qwen/Qwen2.5-14B-Instruct", "--precision", "q4_K_M", "--precision", "q8_0",
                        "--parallel", "4", "--context", "4096"],
    "eager on a 24 GB card": ["meta-llama/Llama-3.1-8B-Instruct", "--precision", "bf16", "--engine-version", "0.8.5",
                              "--gpu-memory-utilization", "0.97", "--context", "57760"],
    "a local directory": [str(MODELS / "google__gemma-2-9b-it"), "--precision", "bf16", "--precision", "q8_0"],
}


@pytest.fixture(scope="module")
def printed(models_dir: Path, fleet_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """What ``ctl model plan --json`` prints for each of PLANS."""
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path_factory.mktemp("hf")), "LLMGW_MODELS_DIR": None}
    out = {}
    for label, args in PLANS.items():
        res = CliRunner().invoke(cli, ["ctl", "model", "plan", *args, "--models-dir", str(models_dir),
                                       "--fleet", str(fleet_file), "--json"], env=env)
        assert res.exit_code == 0, f"{label}: {res.output}"
        out[label] = json.loads(res.output)
        assert out[label]["candidates"], label
    return out


def as_printed(argv: list[str]) -> list[str]:
    """The agent's argv with what only its node knows written as a plan prints it."""
    key = next(k for k, prog in NODE_CMDS.items() if k != "fake" and argv[:len(prog)] == prog)
    out = [*PRINTED_PROGRAMS[key], *argv[len(NODE_CMDS[key]):]]
    shown = {"--port": "6379", "--address": "HEAD:6379"} if key == "ray" else {"--port": "8000", "--host": "0.0.0.0"}
    for flag, value in shown.items():
        if flag in out:
            out[out.index(flag) + 1] = value
    return out


def printed_env(env: dict[str, str]) -> list[str]:
    assert set(env) <= {"RAY_ADDRESS"}
    return [f"{k}=127.0.0.1:6379" for k in env]


def agent_argvs(spec: m.ModelSpec, nodes: tuple[str, ...], config: EngineConfig, bus: Bus,
                ) -> list[tuple[list[list[str]], dict[str, str]]]:
    """What each node's agent starts for one replica of ``spec`` (and the environment it adds), head first."""
    gpus = tuple(m.GpuRef(node=n, index=i, uuid=f"GPU-{n}-{i}") for n in nodes for i in range(spec.tp))
    placed = m.ReplicaPlaced(at=AT, replica_id=f"{spec.name}-r1", model=spec.name, nodes=nodes, gpus=gpus, spec=spec,
                             fabric="f")
    head = EngineRun(nodes[0], placed, config, bus.outbox())
    out = [head._argvs()]
    out += [EngineRun(n, placed, config, bus.outbox(), head_address=head.head_address)._argvs() for n in nodes[1:]]
    return out


async def test_every_printed_command_is_what_the_agent_runs(printed: dict[str, dict[str, Any]], bus: Bus,
                                                           tmp_path: Path) -> None:
    # A node that holds no GGUF in its models directory, listening everywhere, advertised by its name.
    config = EngineConfig(cmds=NODE_CMDS, host="0.0.0.0", advertise_host="gpu-node-1", models_dir=tmp_path / "empty")
    seen: list[list[str]] = []
    for label, reply in printed.items():
        name = P.plan_name(reply["model"])
        for raw in reply["candidates"]:
            c = msgspec.convert(raw, m.Candidate)
            spec = c.spec(name)
            nodes = tuple(f"node-{i}" for i in range(c.pp))
            parts = agent_argvs(spec, nodes, config, bus)
            (*before, engine), _env = parts[0]
            where = f"{label}: {c.precision} tp {c.tp} pp {c.pp} on {c.gpu_class}"
            assert raw["command"] == shlex.join(as_printed(engine)), where
            lines = []
            if c.pp > 1:
                for rank, (argvs, env) in enumerate(parts):
                    *first, last = argvs
                    words = [*(f"{shlex.join(as_printed(a))} &" for a in first), *printed_env(env),
                             shlex.join(as_printed(last))]
                    lines.append(f"node {rank + 1}{' (head)' if rank == 0 else ''}: {' '.join(words)}")
            else:
                assert not before, where
            assert raw["node_commands"] == lines, where
            seen.append(shlex.split(raw["command"]))
    # The plans above reach every flag the spec carries, and each engine's ways to find its weights.
    flags = {" ".join(argv[i:i + 2]) for argv in seen for i in range(len(argv))}
    for wanted in ("--dtype float16", "--dtype bfloat16", "--enforce-eager", "--quantization fp8",
                   "--kv-cache-dtype fp8", "--max-num-seqs 64", "--pipeline-parallel-size 2", "-np 4", "--hf-repo",
                   "-m " + str(MODELS / "google__gemma-2-9b-it" / "gemma-2-9b-it-Q8_0.gguf")):
        assert any(f == wanted or f.startswith(wanted + " ") for f in flags), wanted
    assert any(argv[0] == "llama-server" for argv in seen) and any(argv[:2] == ["vllm", "serve"] for argv in seen)


def _vllm_spec(**kw: object) -> m.ModelSpec:
    base = dict(name="tiny", source="/models/tiny", precision="bf16", engine="vllm", gpu_class="CPU-16GB",
                context=2048, kv_tokens=65_536, kv_gib_per_gpu=2.5, gpu_memory_utilization=0.92, engine_version="0.32.0")
    return m.ModelSpec(**{**base, **kw})  # type: ignore[arg-type]


def test_a_vllm_on_a_simulated_cards_cpu_gets_a_cpu_engines_arguments_from_the_node() -> None:
    """Seen with the vLLM CPU build: 0.92 of a card read as 92 % of host RAM (refused), bf16 attention
    killed the worker on the health check, and the arguments had to be typed by hand."""
    cmds = {"vllm": ["vllm", "serve"]}
    on_gpu = engine_argv(_vllm_spec(), 8000, "127.0.0.1", cmds, simulate=False)
    on_cpu = engine_argv(_vllm_spec(), 8000, "127.0.0.1", cmds, simulate=False, cpu=True)
    assert "--gpu-memory-utilization" in on_gpu and "--kv-cache-memory-bytes" not in on_gpu
    assert "--dtype" not in on_gpu and "--enforce-eager" not in on_gpu
    assert "--gpu-memory-utilization" not in on_cpu
    assert on_cpu[on_cpu.index("--kv-cache-memory-bytes") + 1] == str(int(2.5 * 2**30))
    assert on_cpu[on_cpu.index("--dtype") + 1] == "float32" and on_cpu.count("--enforce-eager") == 1
    # Typed already: not twice. A spec declared before plans carried its KV figure: vLLM's own default.
    typed = engine_argv(_vllm_spec(engine_args=("--enforce-eager",), kv_gib_per_gpu=0.0), 8000, "127.0.0.1", cmds,
                        simulate=False, cpu=True)
    assert typed.count("--enforce-eager") == 1 and "--kv-cache-memory-bytes" not in typed


@pytest.mark.parametrize(("version", "details"), [("0.32.0", True), ("0.6.4", True), ("0.6.3", False), ("", False)])
def test_cached_prompt_tokens_are_asked_of_every_vllm_that_can_say_them(version: str, details: bool) -> None:
    argv = engine_argv(_vllm_spec(engine_version=version), 8000, "127.0.0.1", {"vllm": ["vllm", "serve"]},
                       simulate=False)
    assert ("--enable-prompt-tokens-details" in argv) is details  # a version that lacks it would refuse to start


# What a vLLM that died on start says last (its shape as vLLM 0.32's CPU build prints it): the error
# first, then its shutdown's chatter.
DEAD_VLLM = [
    "INFO 12-01 22:10:02 [cpu_worker.py:101] Warming up model for the compilation...",
    "ERROR 12-01 22:10:11 [core.py:700] EngineCore failed to start.",
    "Traceback (most recent call last):",
    '  File "/venv/lib/python3.11/site-packages/vllm/v1/engine/core.py", line 691, in run_engine_core',
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    *[f"(APIServer pid=4242) INFO 12-01 22:10:12 [launcher.py:{i}] Shutting down" for i in range(30)],
    "nanobind: leaked 2 instances!",
    "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: "
    "There appear to be 1 leaked semaphore objects to clean up at shutdown",
]


def test_a_failures_report_keeps_what_failed_before_the_shutdowns_chatter() -> None:
    """Seen: the tail kept in events was vLLM's shutdown chatter (nanobind, the resource tracker), never the error."""
    from llmgw.engine.argv import failure_tail

    shown = failure_tail(DEAD_VLLM, last=5)
    assert shown[:3] == [DEAD_VLLM[1], DEAD_VLLM[2], DEAD_VLLM[4]]  # the error, the traceback, the exception
    assert not any("nanobind" in s or "resource_tracker" in s for s in shown)
    assert shown[-1] == DEAD_VLLM[-3]  # then the last lines that are not chatter


@pytest.mark.parametrize(("code", "lines", "said"), [
    (-9, [], "engine exited (-9): killed by SIGKILL"),
    (-4, [], "engine exited (-4): killed by SIGILL"),
    (1, ["CUDA out of memory"], "engine exited (1)"),
    # vLLM's front end exits 0 once its engine core died under it: a failure, whatever the status.
    (0, DEAD_VLLM, "engine failed: its engine core died (exit 0): RuntimeError: Engine core initialization failed"),
])
def test_how_an_engine_ended_is_said_from_its_status_and_its_last_words(code: int, lines: list[str],
                                                                        said: str) -> None:
    from llmgw.engine.argv import exit_reason

    assert exit_reason(code, lines).startswith(said)


# --- LoRA adapters --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("rank", "flag"), [(0, None), (1, "1"), (5, "8"), (8, "8"), (12, "16"), (300, "320"),
                                            (600, "512")])
def test_a_vllm_with_adapter_slots_gets_lora_on_a_rank_it_accepts_and_a_cpu_cache_of_twice_its_slots(
        rank: int, flag: str | None) -> None:
    argv = engine_argv(_vllm_spec(max_adapters=3, max_lora_rank=rank), 8000, "h", {"vllm": ["vllm", "serve"]},
                       simulate=False)
    lora = argv[argv.index("--enable-lora"):]
    assert lora[:3] == ["--enable-lora", "--max-loras", "3"]
    # vLLM refuses any --max-lora-rank but 1, 8, 16, … 512; a spec without one gets vLLM's default (16).
    assert (argv[argv.index("--max-lora-rank") + 1] if "--max-lora-rank" in argv else None) == flag
    assert argv[argv.index("--max-cpu-loras") + 1] == "6"


def test_only_a_vllm_with_adapter_slots_runs_with_the_runtime_lora_endpoints() -> None:
    from llmgw.engine.argv import engine_env

    with_slots, without = _vllm_spec(max_adapters=2, max_lora_rank=8), _vllm_spec()
    assert engine_env(with_slots) == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    assert engine_env(without) == {} and engine_env(with_slots, simulate=True) == {}
    argv = engine_argv(without, 8000, "h", {"vllm": ["vllm", "serve"]}, simulate=False)
    assert not any("lora" in a for a in argv)


def test_a_llama_server_attaches_every_adapter_in_its_order_in_one_lora_list() -> None:
    """Given twice, llama-server loads both but warns that only the last is used; its list is CSV."""
    spec = m.ModelSpec(name="tiny", source="/m/tiny", file="tiny-Q8_0.gguf", precision="q8_0", engine="llama.cpp",
                       gpu_class="c", context=512, adapters=(m.AdapterRef(name="sql", path="/a/sql.gguf"),
                                                             m.AdapterRef(name="odd", path='/a/x,"y".gguf')))
    argv = engine_argv(spec, 9, "h", default_commands(), simulate=False)
    assert argv.count("--lora") == 1
    assert argv[argv.index("--lora") + 1] == '/a/sql.gguf,"/a/x,""y"".gguf"'
    fake = engine_argv(spec, 9, "h", default_commands(), simulate=True)
    assert [fake[i + 1] for i, a in enumerate(fake) if a == "--lora"] == ["sql", "odd"]  # ids 0 and 1, by name
    bare = msgspec.structs.replace(spec, adapters=())
    assert "--lora" not in engine_argv(bare, 9, "h", default_commands(), simulate=False)


def test_a_simulated_vllm_gets_the_same_slots_and_the_nodes_load_time() -> None:
    spec = _vllm_spec(max_adapters=2, max_lora_rank=8)
    argv = engine_argv(spec, 7, "h", default_commands(), simulate=True, lora_load_ms=150)
    assert argv[argv.index("--max-loras"):][:6] == ["--max-loras", "2", "--max-cpu-loras", "4", "--lora-load-ms", "150"]
    assert "--lora-load-ms" not in engine_argv(spec, 7, "h", default_commands(), simulate=True)


async def test_a_printed_lora_plan_is_what_the_agent_runs_with_its_environment(bus: Bus, tmp_path: Path) -> None:
    info = model(LLAMA8)
    reply = P.plan(info, fleet(node("n1", "fa", count=1)),
                   m.PlanRequest(model=info.name, precisions=("bf16",), max_adapters=2, max_lora_rank=12))
    c = next(c for c in reply.candidates if c.engine == "vllm")
    config = EngineConfig(cmds=NODE_CMDS, host="0.0.0.0", advertise_host="gpu-node-1", models_dir=tmp_path)
    ((argvs, env),) = agent_argvs(c.spec(P.plan_name(info.name)), ("n1",), config, bus)
    assert env == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    assert c.command == "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True " + shlex.join(as_printed(argvs[-1]))
    assert "--enable-lora --max-loras 2 --max-lora-rank 16 --max-cpu-loras 4" in c.command


def test_a_fake_engines_load_time_from_the_environment_is_bounded() -> None:
    from llmgw.engine.argv import fake_lora_load_ms
    from llmgw.errors import ConfigError

    assert fake_lora_load_ms("150") == 150.0
    for bad in ("-1", "nan", "1e9", "soon"):
        with pytest.raises(ConfigError, match="LLMGW_FAKE_LORA_LOAD_MS"):
            fake_lora_load_ms(bad)
