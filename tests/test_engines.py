"""Engine supervision against a real nats-server and real ``llmgw fake-engine`` processes."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from streams import engine_keys, stored

from llmgw import messages as m
from llmgw import subjects
from llmgw.agent.runs import EngineConfig
from llmgw.agent.supervisor import EngineSupervisor
from llmgw.bus import Bus, Outbox
from llmgw.engine.argv import (
    default_commands,
    engine_argv,
    gguf_location,
    kv_tokens_from_metrics,
    kv_tokens_from_props,
    parse_engine_cmds,
)
from llmgw.errors import ConfigError

NODE = "n1"


def spec(**kw: object) -> m.ModelSpec:
    base: dict[str, object] = dict(name="qwen", source="Qwen/Qwen2.5-14B-Instruct", precision="bf16", engine="vllm",
                                   gpu_class="H100-80GB", context=8192, tp=2)
    base.update(kw)
    return m.ModelSpec(**base)  # type: ignore[arg-type]


def placed(rid: str, node: str = NODE, s: m.ModelSpec | None = None) -> m.ReplicaPlaced:
    s = s or spec()
    gpus = tuple(m.GpuRef(node=node, index=i + 2, uuid=f"GPU-{i}") for i in range(s.tp))
    return m.ReplicaPlaced(at=m.utcnow(), replica_id=rid, model=s.name, nodes=(node,), gpus=gpus, spec=s, fabric="f")


async def states(bus: Bus) -> list[m.ReplicaStateChanged]:
    return [e for e in await stored(bus, subjects.STREAM_CONTROL) if isinstance(e, m.ReplicaStateChanged)]


async def wait_for(bus: Bus, cond: Callable[[list[m.ReplicaStateChanged]], bool], within_s: float = 20.0) -> list[m.ReplicaStateChanged]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        got = await states(bus)
        if cond(got):
            return got
        assert loop.time() < deadline, f"states so far: {[(s.replica_id, s.state, s.detail) for s in got]}"
        await asyncio.sleep(0.1)


async def place_over_two_nodes(bus: Bus, fabric: str = "f") -> None:
    """qwen-r1, tp 1 × pp 2: this test's node (the head) and n2."""
    s = spec(tp=1, pp=2)
    gpus = tuple(m.GpuRef(node=n, index=0, uuid=f"GPU-{n}") for n in (NODE, "n2"))
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=s))
    await bus.publish(m.ReplicaPlaced(at=m.utcnow(), replica_id="qwen-r1", model="qwen", nodes=(NODE, "n2"),
                                      gpus=gpus, spec=s, fabric=fabric))


@pytest.fixture
async def agent(bus: Bus) -> AsyncIterator[tuple[Outbox, Callable[[EngineConfig], EngineSupervisor]]]:
    """An outbox delivering like the agent's, and supervisors started on demand (stopped after)."""
    outbox = bus.outbox()
    tasks = [asyncio.create_task(outbox.run())]

    def start(config: EngineConfig) -> EngineSupervisor:
        sup = EngineSupervisor(NODE, config)
        tasks.append(asyncio.create_task(sup.run(bus, outbox)))
        return sup

    try:
        yield outbox, start
    finally:
        for t in reversed(tasks):
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)


def test_engine_command_lines() -> None:
    cmds = parse_engine_cmds(["vllm=/opt/v/bin/vllm serve"])
    argv = engine_argv(spec(quantization="fp8", pp=2), 8001, "0.0.0.0", cmds, simulate=False)
    assert argv == ["/opt/v/bin/vllm", "serve", "Qwen/Qwen2.5-14B-Instruct", "--tensor-parallel-size", "2",
                    "--pipeline-parallel-size", "2", "--distributed-executor-backend", "ray", "--quantization", "fp8", "--max-model-len", "8192",
                    "--gpu-memory-utilization", "0.9", "--host", "0.0.0.0", "--port", "8001", "--served-model-name", "qwen"]
    gguf = spec(engine="llama.cpp", source="/models/q.gguf", precision="q4_K_M", tp=1)
    assert engine_argv(gguf, 9, "h", default_commands(), simulate=False) == [
        "llama-server", "-m", "/models/q.gguf", "-c", "8192", "-np", "1", "-ngl", "999", "--host", "h", "--port", "9",
        "--alias", "qwen"]
    vllm_seqs = engine_argv(spec(parallel=64), 1, "h", cmds, simulate=False)
    assert vllm_seqs[vllm_seqs.index("--max-num-seqs") + 1] == "64"
    fp16 = engine_argv(spec(precision="fp16", dtype="float16"), 1, "h", cmds, simulate=False)
    assert fp16[5:7] == ["--dtype", "float16"] and "--dtype" not in argv  # "auto": the checkpoint's own
    sim = engine_argv(spec(), 7, "h", default_commands(), simulate=True, name="qwen-r1")
    assert sim[-9:] == ["fake-engine", "--host", "h", "--port", "7", "--model", "qwen", "--name", "qwen-r1"]
    assert parse_engine_cmds(["vllm=/opt/v/bin/vllm"])["vllm"] == ["/opt/v/bin/vllm", "serve"]
    with pytest.raises(ConfigError, match="expected ENGINE=CMD"):
        parse_engine_cmds(["sglang=python -m sglang"])


async def test_reconciles_on_start_serves_restarts_and_stops(bus: Bus, agent: tuple[Outbox, Callable[[EngineConfig], EngineSupervisor]]) -> None:
    # Placed before the supervisor starts: reconciling must start it anyway.
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec()))
    await bus.publish(placed("qwen-r1"))
    await bus.publish(placed("other-r1", node="n2"))
    _, start = agent
    sup = start(EngineConfig(simulate=True, health_timeout_s=20, backoff_base_s=0.1))
    got = await wait_for(bus, lambda ss: any(s.state == "healthy" for s in ss))
    healthy = next(s for s in got if s.state == "healthy")
    assert healthy.replica_id == "qwen-r1" and healthy.node == NODE and healthy.endpoint.startswith("http://127.0.0.1:")
    assert {s.replica_id for s in got} == {"qwen-r1"}  # n2's replica is not ours
    chat = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}]}
    # Issue 45, finding 3: straight to the engine without its key is 401; with the key the routers read, 200.
    [issued] = await engine_keys(bus)
    assert issued.replica_id == "qwen-r1" and issued.node == NODE and issued.endpoint == healthy.endpoint
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{healthy.endpoint}/v1/chat/completions", json=chat) as r:
            assert r.status == 401
        async with http.post(f"{healthy.endpoint}/v1/chat/completions", json=chat,
                             headers={"Authorization": f"Bearer {issued.key}"}) as r:
            assert r.status == 200
            assert r.headers["x-llmgw-replica"] == "qwen-r1"
    run = sup.runs["qwen-r1"]
    assert run.proc is not None
    # The key is in the engine's environment, not its command line (which `ps` shows every user).
    assert issued.key.encode() not in await asyncio.to_thread(Path(f"/proc/{run.proc.pid}/cmdline").read_bytes)

    # A crash: restarted, reported with its restart count, healthy again.
    os.killpg(run.proc.pid, signal.SIGKILL)
    got = await wait_for(bus, lambda ss: any(s.state == "healthy" and s.restarts == 1 for s in ss))
    assert [s.state for s in got] == ["starting", "healthy", "unhealthy", "starting", "healthy"]
    assert "engine exited (-9): killed by SIGKILL; restart 1 of 3" in got[2].detail
    # The restarted engine has a new key (the stream keeps only it); the old one opens nothing.
    [again] = await engine_keys(bus)
    assert again.key != issued.key and again.restarts == 1 and again.endpoint == got[-1].endpoint
    async with aiohttp.ClientSession() as http:
        for key, status in ((issued.key, 401), (again.key, 200)):
            async with http.post(f"{again.endpoint}/v1/chat/completions", json=chat,
                                 headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status == status

    # Stopped on request: the process is gone and the stop is on record.
    pid = sup.runs["qwen-r1"].proc.pid  # type: ignore[union-attr]
    await bus.publish(m.ReplicaStopped(at=m.utcnow(), replica_id="qwen-r1", model="qwen", reason="idle"))
    got = await wait_for(bus, lambda ss: ss[-1].state == "stopped")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_engine_that_keeps_failing_reports_its_log(bus: Bus, agent: tuple[Outbox, Callable[[EngineConfig], EngineSupervisor]]) -> None:
    oom = "import sys; print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB'); sys.exit(1)"
    cmds = default_commands() | {"fake": [sys.executable, "-c", oom]}
    _, start = agent
    start(EngineConfig(cmds=cmds, simulate=True, health_timeout_s=5, max_restarts=1, backoff_base_s=0.05))
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec()))
    await bus.publish(placed("qwen-r1"))
    got = await wait_for(bus, lambda ss: any(s.state == "failed" for s in ss))
    failed = got[-1]
    assert failed.state == "failed" and failed.restarts == 1
    assert "engine exited (1) after 1 restarts" in failed.detail and "CUDA out of memory" in failed.detail


async def test_missing_engine_binary_fails_with_next_step(bus: Bus, agent: tuple[Outbox, Callable[[EngineConfig], EngineSupervisor]]) -> None:
    _, start = agent
    start(EngineConfig(cmds=default_commands() | {"vllm": ["/nonexistent/vllm", "serve"]}))
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec()))
    await bus.publish(placed("qwen-r1"))
    got = await wait_for(bus, lambda ss: any(s.state == "failed" for s in ss))
    assert "cannot start /nonexistent/vllm" in got[-1].detail and "--engine-cmd vllm=" in got[-1].detail


def test_engine_hosts_default_by_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    monkeypatch.delenv("LLMGW_ENGINE_HOST", raising=False)
    monkeypatch.delenv("LLMGW_ADVERTISE_HOST", raising=False)
    sim = EngineConfig(simulate=True)
    assert (sim.host, sim.advertise_host, sim.check_host) == ("127.0.0.1", "127.0.0.1", "127.0.0.1")
    real = EngineConfig()
    assert (real.host, real.advertise_host, real.check_host) == ("0.0.0.0", socket.gethostname(), "127.0.0.1")
    monkeypatch.setenv("LLMGW_ADVERTISE_HOST", "10.1.2.3")
    assert EngineConfig().advertise_host == "10.1.2.3"


async def test_an_engine_listens_only_where_the_agent_is_told(
        bus: Bus, agent: tuple[Outbox, Callable[[EngineConfig], EngineSupervisor]]) -> None:
    """Issue 45, finding 3: `agent --engine-host` is the one address an engine listens on (and is dialled at)."""
    from llmgw.cli.agent import engine_config

    told = engine_config({"engines": "real", "simulated": False, "engine_cmds": default_commands(), "engine_startup_s": 0,
                          "engine_env": {}, "log_dir": None, "log_max_bytes": 1 << 20, "log_keep": 1,
                          "engine_host": "10.9.8.7", "advertise_host": "gpu-01.example"})
    assert (told.host, told.advertise_host, told.check_host) == ("10.9.8.7", "gpu-01.example", "10.9.8.7")
    _, start = agent
    start(EngineConfig(simulate=True, host="127.0.0.2", health_timeout_s=20))
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec()))
    await bus.publish(placed("qwen-r1"))
    got = await wait_for(bus, lambda ss: any(s.state == "healthy" for s in ss))
    endpoint = got[-1].endpoint
    assert endpoint.startswith("http://127.0.0.2:")
    port = int(endpoint.rsplit(":", 1)[1])
    with pytest.raises(OSError):  # not on every interface: 127.0.0.1 is another address
        await asyncio.open_connection("127.0.0.1", port)


def test_kv_tokens_are_read_from_vllms_metrics() -> None:
    # The line as vLLM 0.11 prints it on /metrics (labels abridged to the ones that matter and a few others).
    line = ('vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",'
            'enable_prefix_caching="True",gpu_memory_utilization="0.9",num_cpu_blocks="None",'
            'num_gpu_blocks="27153",swap_space="4"} 1.0')
    text = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n" + line + "\nvllm:num_requests_running 0\n"
    assert kv_tokens_from_metrics(text) == 27153 * 16
    assert kv_tokens_from_metrics("vllm:num_requests_running 0\n") == 0
    assert kv_tokens_from_metrics('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0') == 0


async def test_a_healthy_engine_reports_what_it_reserved(bus: Bus, agent: tuple[Outbox, Callable[[EngineConfig], EngineSupervisor]]) -> None:
    s = spec(kv_tokens=100_000)
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=s))
    await bus.publish(placed("qwen-r1", s=s))
    _, start = agent
    start(EngineConfig(simulate=True, health_timeout_s=20))
    got = await wait_for(bus, lambda ss: any(x.state == "healthy" for x in ss))
    healthy = next(x for x in got if x.state == "healthy")
    # The fake engine claims 97% of the plan, in vLLM's blocks of 16, and the agent reads it back.
    assert healthy.observed_kv_tokens == 97_000 // 16 * 16


FAKE_RAY = f"""#!{sys.executable}
import os, sys, time
with open(os.environ["LLMGW_TEST_RECORD"], "a") as f:
    f.write("ray " + " ".join(sys.argv[1:]) + "\\n")
print("Ray runtime started.", flush=True)
while True:
    time.sleep(1)
"""

FAKE_VLLM = f"""#!{sys.executable}
import os, sys
with open(os.environ["LLMGW_TEST_RECORD"], "a") as f:
    f.write("vllm " + " ".join(sys.argv[1:]) + " NCCL_SOCKET_IFNAME=" + os.environ.get("NCCL_SOCKET_IFNAME", "")
            + " RAY_ADDRESS=" + os.environ.get("RAY_ADDRESS", "") + "\\n")
a = sys.argv
os.execv(sys.executable, [sys.executable, "-m", "llmgw", "fake-engine",
         "--host", a[a.index("--host") + 1], "--port", a[a.index("--port") + 1],
         "--model", a[a.index("--served-model-name") + 1]])
"""


async def test_a_replica_over_two_nodes_runs_ray_and_vllm_as_documented(
    bus: Bus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = tmp_path / "record.txt"
    record.touch()
    monkeypatch.setenv("LLMGW_TEST_RECORD", str(record))
    for name, text in (("ray", FAKE_RAY), ("vllm", FAKE_VLLM)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    cmds = parse_engine_cmds([f"vllm={tmp_path / 'vllm'}", f"ray={tmp_path / 'ray'}"])
    s = spec(tp=2, pp=2)
    gpus = tuple(m.GpuRef(node=n, index=i, uuid=f"GPU-{n}-{i}") for n in ("n1", "n2") for i in range(2))
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=s))
    await bus.publish(m.ReplicaPlaced(at=m.utcnow(), replica_id="qwen-r1", model="qwen", nodes=("n1", "n2"),
                                      gpus=gpus, spec=s, fabric="f"))
    outbox = bus.outbox()
    config = EngineConfig(cmds=cmds, simulate=False, host="127.0.0.1", advertise_host="127.0.0.1", health_timeout_s=20,
                          env={"NCCL_SOCKET_IFNAME": "ib0"})
    tasks = [asyncio.create_task(outbox.run())]
    tasks += [asyncio.create_task(EngineSupervisor(n, config).run(bus, outbox)) for n in ("n1", "n2")]
    try:
        got = await wait_for(bus, lambda ss: {(x.node, x.state) for x in ss} >= {("n1", "healthy"), ("n2", "healthy")})
    finally:
        for t in reversed(tasks):
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)
    head = next(x for x in got if x.node == "n1" and x.head_address)
    lines = record.read_text().splitlines()
    port = head.head_address.rsplit(":", 1)[1]
    assert f"ray start --head --port {port} --num-gpus 2 --block" in lines
    assert f"ray start --address {head.head_address} --num-gpus 2 --block" in lines
    vllm = next(x for x in lines if x.startswith("vllm "))
    assert ("--tensor-parallel-size 2 --pipeline-parallel-size 2 --distributed-executor-backend ray" in vllm
            and vllm.endswith(f"NCCL_SOCKET_IFNAME=ib0 RAY_ADDRESS=127.0.0.1:{port}"))
    # Replay shows what each node ran.
    starting = {x.node: x.detail for x in got if x.state == "starting" and x.detail.startswith("part ")}
    assert starting["n1"].startswith("part 1 of 2: ") and "ray start --head" in starting["n1"] and "vllm" in starting["n1"]
    assert starting["n2"].startswith("part 2 of 2: ") and f"ray start --address {head.head_address}" in starting["n2"]
    # The head serves and says so with its endpoint; the worker's part has none.
    assert next(x for x in got if x.node == "n1" and x.state == "healthy").endpoint.startswith("http://127.0.0.1:")
    assert next(x for x in got if x.node == "n2" and x.state == "healthy").endpoint == ""


async def test_a_node_without_ray_fails_once_with_what_is_missing(
    bus: Bus, agent: tuple[Outbox, Callable[[EngineConfig], EngineSupervisor]]
) -> None:
    await place_over_two_nodes(bus)
    _, start = agent
    start(EngineConfig(cmds=parse_engine_cmds(["ray=/nonexistent/ray"]), simulate=False, health_timeout_s=5))
    got = await wait_for(bus, lambda ss: any(x.state == "failed" for x in ss))
    failed = [x for x in got if x.state == "failed"]
    assert len(failed) == 1 and "cannot start /nonexistent/ray" in failed[0].detail
    assert "--engine-cmd ray=" in failed[0].detail


async def test_a_placement_naming_another_fabric_is_refused_not_run(
    bus: Bus, agent: tuple[Outbox, Callable[[EngineConfig], EngineSupervisor]]
) -> None:
    await place_over_two_nodes(bus, fabric="ib-b")
    _, start = agent
    sup = start(EngineConfig(simulate=True, health_timeout_s=5))
    sup.fabric_of = lambda: "ib-a"
    got = await wait_for(bus, lambda ss: any(x.state == "failed" for x in ss))
    assert [x.state for x in got] == ["failed"]
    assert "placed on fabric ib-b, but n1 is on ib-a" in got[0].detail
    assert sup.runs == {} and sup.refused == {"qwen-r1"}


def test_kv_tokens_are_read_from_llama_servers_props() -> None:
    # The shape of llama-server's GET /props (abridged): n_ctx is each slot's share of -c.
    props = '{"default_generation_settings": {"n_ctx": 8192, "params": {"temperature": 0.8}}, "total_slots": 1}'
    assert kv_tokens_from_props(props) == 8192
    assert kv_tokens_from_props(props.replace('"total_slots": 1', '"total_slots": 4')) == 4 * 8192
    assert kv_tokens_from_props('{"n_ctx": 4096}') == 4096
    assert kv_tokens_from_props("not json") == 0 and kv_tokens_from_props("[]") == 0
    # Bounded where decoded: an engine's figure never overflows what an event may carry.
    assert kv_tokens_from_props('{"n_ctx": 4096, "total_slots": 1e400}') == 0
    assert kv_tokens_from_props('{"n_ctx": 99999999999999999999, "total_slots": 2}') == 0


@pytest.mark.parametrize(("source", "file", "where"), [
    # The planner records a bare name: it lives in the model's directory, wherever the agent runs.
    ("/models/tiny", "tiny-Q8_0.gguf", ["-m", "/models/tiny/tiny-Q8_0.gguf"]),
    ("/models/tiny", "/elsewhere/t.gguf", ["-m", "/elsewhere/t.gguf"]),  # deploy --file PATH
    ("/models/tiny-Q8_0.gguf", None, ["-m", "/models/tiny-Q8_0.gguf"]),
    ("./models/tiny", "t.gguf", ["-m", "models/tiny/t.gguf"]),  # not an Org/Name id, so a path
    # Only a repository id is downloaded, by llama-server itself.
    ("Qwen/Qwen2.5-14B-Instruct-GGUF", "q.gguf", ["--hf-repo", "Qwen/Qwen2.5-14B-Instruct-GGUF", "--hf-file", "q.gguf"]),
])
def test_a_gguf_is_found_in_the_models_directory(source: str, file: str | None, where: list[str]) -> None:
    s = spec(engine="llama.cpp", source=source, file=file, precision="q8_0", tp=1, context=512)
    assert gguf_location(s) == where


def test_a_repositorys_gguf_in_the_agents_models_directory_is_not_downloaded(tmp_path: Path) -> None:
    s = spec(engine="llama.cpp", source="Org/Tiny", file="Tiny-Q8_0.gguf", precision="q8_0", tp=1, context=512)
    assert gguf_location(s, tmp_path)[0] == "--hf-repo"  # not there: llama-server downloads it (curl builds only)
    (tmp_path / "Org__Tiny").mkdir()
    (tmp_path / "Org__Tiny" / "Tiny-Q8_0.gguf").write_bytes(b"GGUF")
    assert gguf_location(s, tmp_path) == ["-m", str(tmp_path / "Org__Tiny" / "Tiny-Q8_0.gguf")]


def test_llama_cpp_slots_each_get_the_declared_context() -> None:
    s = spec(engine="llama.cpp", source="/m", file="t.gguf", precision="q8_0", tp=1, context=4096, parallel=8)
    argv = engine_argv(s, 9, "h", default_commands(), simulate=False)
    assert argv[argv.index("-c") + 1] == "32768" and argv[argv.index("-np") + 1] == "8"
    assert s.kv_tokens_planned == 32768


async def test_a_head_whose_other_part_never_joins_is_never_healthy(
    bus: Bus, agent: tuple[Outbox, Callable[[EngineConfig], EngineSupervisor]]
) -> None:
    await place_over_two_nodes(bus)
    _, start = agent
    sup = start(EngineConfig(simulate=True, health_timeout_s=60))  # n2's agent never runs
    got = await wait_for(bus, lambda ss: any(x.head_address for x in ss))
    run = sup.runs["qwen-r1"]
    async with aiohttp.ClientSession() as http:
        for _ in range(50):  # the fake head is up: it says what it waits for
            try:
                async with http.get(f"http://127.0.0.1:{run.port}/health") as r:
                    body = await r.text()
                    break
            except aiohttp.ClientError:
                await asyncio.sleep(0.1)
    assert r.status == 503 and "waiting for parts (1 of 2)" in body
    assert all(x.state != "healthy" for x in await states(bus)) and got[-1].node == NODE


# An engine that is up and answers /health, but refuses the check's completion as vLLM does a model
# name it does not serve. Before: "starting" for the whole health timeout (15 minutes), no reason.
REFUSING_ENGINE = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, code, doc):
        body = json.dumps(doc).encode()
        self.send_response(code); self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def do_GET(self): self._send(200, {})
    def do_POST(self): self._send(404, {"error": {"message": "The model `qwen` does not exist.", "code": 404}})
srv = HTTPServer(("127.0.0.1", port), H)
print(f"listening on http://127.0.0.1:{srv.server_port}", flush=True)
srv.serve_forever()
"""


async def test_an_engine_that_refuses_the_health_check_fails_soon_with_the_reason(
        bus: Bus, agent: tuple[Outbox, Callable[[EngineConfig], EngineSupervisor]]) -> None:
    cmds = default_commands() | {"fake": [sys.executable, "-c", REFUSING_ENGINE]}
    _, start = agent
    start(EngineConfig(cmds=cmds, simulate=True, health_timeout_s=900, health_refused_s=0.5, max_restarts=0))
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec()))
    await bus.publish(placed("qwen-r1"))
    got = await wait_for(bus, lambda ss: any(s.state == "failed" for s in ss))
    assert [s.state for s in got] == ["starting", "failed"]
    assert "the engine is up but refuses the health check for 0.5s" in got[-1].detail
    assert "answered 404" in got[-1].detail and "does not exist" in got[-1].detail


async def test_a_placement_on_another_subject_starts_nothing(
    bus: Bus, agent: tuple[Outbox, Callable[[EngineConfig], EngineSupervisor]]
) -> None:
    """What every reader refuses (here: a payload naming another replica than its subject), it never starts."""
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec()))
    forged = placed("qwen-r9")
    await bus.publish_bytes(subjects.replica("qwen-r1", "placed"), m.encode(forged), "forged-placement")
    await bus.publish(placed("qwen-r2"))
    _, start = agent
    sup = start(EngineConfig(simulate=True, health_timeout_s=20))
    got = await wait_for(bus, lambda ss: any(s.state == "healthy" for s in ss))
    assert {s.replica_id for s in got} == {"qwen-r2"}
    assert "qwen-r9" not in sup.placed and set(sup.checkpoint.state.replicas) == {"qwen-r2"}


def test_an_engine_log_rotates_by_size_and_keeps_the_newest(tmp_path: Path) -> None:
    """A chatty engine serving for weeks must not fill the disk: <replica>.log rolls to .1, .2, the oldest goes."""
    from llmgw.agent.runs import RotatingLog

    path = tmp_path / "m-r1.log"
    log = RotatingLog(path, max_bytes=250, keep=2)
    lines = [f"line {i:03d} ".encode() + b"x" * 90 + b"\n" for i in range(10)]  # 100 bytes each
    for line in lines:
        log.write(line)
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["m-r1.log", "m-r1.log.1", "m-r1.log.2"]
    assert all(p.stat().st_size <= 250 for p in tmp_path.iterdir())
    kept = b"".join((tmp_path / n).read_bytes() for n in ("m-r1.log.2", "m-r1.log.1", "m-r1.log"))
    assert kept == b"".join(lines[-len(kept) // 100:]) and len(kept) == 600  # the newest, in order

    # Two processes of one part (Ray's and vLLM's output) write one file: after one rotates it,
    # the other's next line goes to the new file, not into the rotated one.
    a, b = RotatingLog(path, 250, 2), RotatingLog(path, 250, 2)
    a.write(b"a" * 99 + b"\n")  # the file was full: a rotates first
    b.write(b"b" * 99 + b"\n")
    assert path.read_bytes() == b"a" * 99 + b"\n" + b"b" * 99 + b"\n"
    a.close()
    b.close()
    nothing = RotatingLog(tmp_path / "other.log", 10, 0)  # keep 0: the log is cut, nothing kept
    nothing.write(b"0123456789\n")
    nothing.write(b"new\n")
    nothing.close()
    assert (tmp_path / "other.log").read_bytes() == b"new\n" and not (tmp_path / "other.log.1").exists()


def test_a_full_disk_costs_the_log_its_lines_never_the_engine_its_pipe(caplog: pytest.LogCaptureFixture) -> None:
    """/dev/full answers every write with ENOSPC: the log says so once and the pump goes on."""
    from llmgw.agent.runs import RotatingLog

    log = RotatingLog(Path("/dev/full"), max_bytes=1024, keep=1)
    with caplog.at_level("WARNING", logger="llmgw.agent.runs"):
        for _ in range(3):
            log.write(b"a line the engine printed\n")  # raises nothing
    log.close()
    warned = [r for r in caplog.records if "dropped from the file" in r.getMessage()]
    assert len(warned) == 1 and "No space left" in warned[0].getMessage()


# vLLM's shape: `vllm serve` forks EngineCore and its workers, which inherit its stdout and outlive a
# leader that is SIGKILLed. Here the leader forks a grandchild that holds the pipe and sleeps, then
# becomes the fake engine (which answers the health check).
ORPHANING_ENGINE = """
import os, sys, time
if os.fork() == 0:
    print(f"grandchild {os.getpid()} holds the pipe", flush=True)
    while True:
        time.sleep(1)
fake = FAKE_ENGINE
os.execv(fake[0], [*fake, *sys.argv[1:]])
"""


async def test_a_killed_leader_is_seen_and_its_whole_group_goes_with_it(
        bus: Bus, agent: tuple[Outbox, Callable[[EngineConfig], EngineSupervisor]]) -> None:
    from llmgw.proc import group_members

    cmds = default_commands() | {"fake": [sys.executable, "-c", ORPHANING_ENGINE.replace("FAKE_ENGINE", repr(default_commands()["fake"]))]}
    _, start = agent
    sup = start(EngineConfig(cmds=cmds, simulate=True, health_timeout_s=20, backoff_base_s=0.1))
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec()))
    await bus.publish(placed("qwen-r1"))
    await wait_for(bus, lambda ss: any(s.state == "healthy" for s in ss))
    leader = sup.runs["qwen-r1"].proc.pid  # type: ignore[union-attr]
    assert len(group_members(leader)) == 2  # the engine and the grandchild it forked, in the group it leads

    os.kill(leader, signal.SIGKILL)  # the leader alone, as `kill -9 $(pgrep -f "vllm serve")` does
    got = await wait_for(bus, lambda ss: any(s.state == "unhealthy" for s in ss))
    assert group_members(leader) == set()  # gone by the time the replica is said to be unhealthy
    # The unhealthy report itself: the restart's ``starting`` may already follow it 0.1 s later.
    unhealthy = next(s for s in reversed(got) if s.state == "unhealthy")
    assert "engine exited (-9): killed by SIGKILL; restart 1 of 3" in unhealthy.detail

    # Restarted; a stop on request ends the new group too, grandchild and all.
    await wait_for(bus, lambda ss: ss[-1].state == "healthy" and ss[-1].restarts == 1)
    again = sup.runs["qwen-r1"].proc.pid  # type: ignore[union-attr]
    assert again != leader and len(group_members(again)) == 2
    await bus.publish(m.ReplicaStopped(at=m.utcnow(), replica_id="qwen-r1", model="qwen", reason="idle"))
    await wait_for(bus, lambda ss: ss[-1].state == "stopped")
    assert group_members(again) == set()
