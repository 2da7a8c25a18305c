"""LoRA adapters on the engines themselves, started as the agent starts them (``engine_argv``, ``engine_env``).

Simulated first (the agent's fake engines, given a spec's adapter slots and attached adapters),
then the real ones, on the demo model and its demo adapters: llama-server with two GGUF adapters
attached, each applied by a request's ``lora`` scales (every request names every adapter's
scale: one without the list reuses a prompt cache computed without them); and the vLLM CPU
build with one LoRA slot and two PEFT adapters loaded at runtime, answering otherwise than the
base and each other. Engine-level only: what the router does with them is tested with the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from llama import call, free_port, llama_server_bin  # noqa: F401 - the fixture is used by name
from streams import engine_keys, stored
from vllm_cpu import vllm_binary

from llmgw import messages as m
from llmgw import subjects
from llmgw.agent.runs import EngineConfig
from llmgw.agent.supervisor import EngineSupervisor
from llmgw.bus import Bus
from llmgw.engine.argv import default_commands, engine_argv, engine_env
from llmgw.engine.demolora import write_demo_lora
from llmgw.engine.demomodel import write_demo_model
from llmgw.planner import adapters

NODE = "n1"
MIB = 1 << 20


@contextlib.asynccontextmanager
async def healthy_on_this_node(bus: Bus, spec: m.ModelSpec, config: EngineConfig
                               ) -> AsyncIterator[tuple[str, dict[str, str]]]:
    """``spec`` placed here and its engine run by the agent's supervisor, until healthy: its endpoint, and the
    headers with its API key (as the routers read it) that it takes requests with."""
    outbox = bus.outbox()
    tasks = [asyncio.create_task(outbox.run()), asyncio.create_task(EngineSupervisor(NODE, config).run(bus, outbox))]
    try:
        await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec))
        await bus.publish(m.ReplicaPlaced(at=m.utcnow(), replica_id=f"{spec.name}-r1", model=spec.name, nodes=(NODE,),
                                          gpus=(m.GpuRef(node=NODE, index=0, uuid="GPU-0"),), spec=spec, fabric="f"))
        async with asyncio.timeout(30):
            while True:
                got = [e for e in await stored(bus, subjects.STREAM_CONTROL) if isinstance(e, m.ReplicaStateChanged)]
                assert not [e for e in got if e.state == "failed"], [e.detail for e in got]
                if healthy := [e for e in got if e.state == "healthy"]:
                    break
                await asyncio.sleep(0.1)
        [issued] = await engine_keys(bus)
        yield healthy[0].endpoint, {"Authorization": f"Bearer {issued.key}"}
    finally:
        for t in reversed(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _post(http: aiohttp.ClientSession, url: str, body: object) -> tuple[int, str]:
    async with http.post(url, json=body) as r:
        return r.status, await r.text()


def _vllm(**kw: object) -> m.ModelSpec:
    base: dict[str, object] = dict(name="tiny", source="/models/tiny", precision="bf16", engine="vllm",
                                   gpu_class="CPU-16GB", context=512, engine_version="0.32.0")
    return m.ModelSpec(**{**base, **kw})  # type: ignore[arg-type]


# --- simulated: what the agent gives its fake engines ---------------------------------------------------


async def test_a_simulated_vllm_with_adapter_slots_loads_them_at_runtime_in_the_nodes_load_time(bus: Bus) -> None:
    spec = _vllm(max_adapters=1, max_lora_rank=8)
    async with healthy_on_this_node(bus, spec, EngineConfig(simulate=True, fake_lora_load_ms=5)) as (url, keyed), \
            aiohttp.ClientSession(headers=keyed) as http:
        assert await _post(http, f"{url}/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": "/a1"}) == (
            200, "Success: LoRA adapter 'a1' added successfully.")
        status, text = await _post(http, f"{url}/v1/completions", {"model": "a1", "prompt": "hi"})
        assert status == 200 and json.loads(text)["choices"][0]["text"] == "hello from tiny-r1 (adapter a1)"
        assert (await _post(http, f"{url}/v1/completions", {"model": "a2", "prompt": "hi"}))[0] == 404
        async with http.get(f"{url}/stats") as r:
            stats = await r.json()
    # The cache the agent gave it: twice its slots (argv.CPU_LORAS_PER_SLOT), so nothing was dropped.
    assert (stats["loads"], stats["evictions"], stats["adapters"]) == (1, 0, {"a1": 1})


async def test_a_simulated_llama_server_attaches_the_specs_adapters_in_order(bus: Bus) -> None:
    spec = m.ModelSpec(name="tiny", source="/m", file="tiny-Q8_0.gguf", precision="q8_0", engine="llama.cpp",
                       gpu_class="CPU-16GB", context=512,
                       adapters=(m.AdapterRef(name="sql", path="/a/sql.gguf"), m.AdapterRef(name="chat", path="/a/c.gguf")))
    async with healthy_on_this_node(bus, spec, EngineConfig(simulate=True)) as (url, keyed), \
            aiohttp.ClientSession(headers=keyed) as http:
        status, text = await _post(http, f"{url}/v1/completions",
                                   {"prompt": "hi", "lora": [{"id": 0, "scale": 0}, {"id": 1, "scale": 1}]})
        assert status == 200 and json.loads(text)["choices"][0]["text"] == "hello from tiny-r1 (adapter chat)"
        assert (await _post(http, f"{url}/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}))[0] == 404


FAKE_VLLM = f"""#!{sys.executable}
import os, sys
with open(os.environ["LLMGW_TEST_RECORD"], "a") as f:
    f.write(repr(os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")) + " " + " ".join(sys.argv[1:]) + "\\n")
a = sys.argv
os.execv(sys.executable, [sys.executable, "-m", "llmgw", "fake-engine", "--host", a[a.index("--host") + 1],
         "--port", a[a.index("--port") + 1], "--model", a[a.index("--served-model-name") + 1],
         *(["--max-loras", a[a.index("--max-loras") + 1]] if "--max-loras" in a else [])])
"""


@pytest.mark.parametrize("slots", [2, 0])
async def test_a_real_vllm_is_started_with_the_runtime_lora_endpoints_only_with_adapter_slots(
        bus: Bus, tmp_path: Path, slots: int) -> None:
    """vLLM registers /v1/load_lora_adapter only with VLLM_ALLOW_RUNTIME_LORA_UPDATING set ("1" or "true")."""
    program, record = tmp_path / "vllm", tmp_path / "record"
    program.write_text(FAKE_VLLM)
    program.chmod(0o755)
    config = EngineConfig(cmds={**default_commands(), "vllm": [str(program), "serve"]}, host="127.0.0.1",
                          env={"LLMGW_TEST_RECORD": str(record)}, health_timeout_s=30)
    async with healthy_on_this_node(bus, _vllm(max_adapters=slots, max_lora_rank=16 if slots else 0), config):
        pass
    said = record.read_text().splitlines()[0]
    if slots:
        assert said.startswith("'True' ") and "--enable-lora --max-loras 2 --max-lora-rank 16 --max-cpu-loras 4" in said
    else:
        assert said.startswith("None ") and "lora" not in said.removeprefix("None ")


# --- the real engines -----------------------------------------------------------------------------------


@contextlib.contextmanager
def running(argv: Sequence[str], env: Mapping[str, str], log: Path, port: int, ready_s: float) -> Iterator[str]:
    """An engine started from ``argv`` (its own process group, output in ``log``), until /health answers 200."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **env}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if proc.poll() is not None:
                pytest.fail(f"{argv[0]} exited {proc.returncode} before it was ready:\n{log.read_text()[-6000:]}",
                            pytrace=False)
            with contextlib.suppress(OSError):
                if call(f"{url}/health", timeout=2)[0] == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"{argv[0]} was not ready within {ready_s:.0f}s:\n{log.read_text()[-6000:]}", pytrace=False)
            time.sleep(0.2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what the leader left behind (vLLM's engine core)
        proc.wait(timeout=10)


def _plain(url: str, body: dict[str, Any]) -> tuple[int, str]:
    """POST ``body``: the status and the reply as text (vLLM answers a load or an unload in plain text)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _text(url: str, body: dict[str, Any]) -> str:
    status, reply = call(url, body, timeout=120)
    assert status == 200, reply
    return str(reply["choices"][0]["text"])


_BUFFER = re.compile(r"loading lora adapter from '([^']+)'.*?LoRA buffer size =\s+([\d.]+) MiB", re.DOTALL)


@pytest.mark.timeout(50 * 60)  # the first run on a machine builds llama-server (tests/llama.py)
def test_llama_server_applies_each_attached_demo_adapter_by_the_requests_scales(
        tmp_path: Path, llama_server_bin: Path) -> None:  # noqa: F811
    d = tmp_path / "tiny"
    model = write_demo_model(d, context=512)
    small = write_demo_lora(d, "sql", rank=8, alpha=16)
    large = write_demo_lora(d, "chat", rank=64, alpha=128)
    spec = m.ModelSpec(name="tiny", source=str(d), file=model.gguf.name, precision="q8_0", engine="llama.cpp",
                       gpu_class="CPU-16GB", context=512, engine_args=("-t", "2", "-lv", "4"),
                       adapters=(m.AdapterRef(name="sql", path=str(small.path)),
                                 m.AdapterRef(name="chat", path=str(large.path))))
    port, log = free_port(), tmp_path / "llama-server.log"
    argv = engine_argv(spec, port, "127.0.0.1", {"llama.cpp": [str(llama_server_bin)]}, simulate=False)
    with running(argv, engine_env(spec), log, port, ready_s=60) as url:
        status, listed = call(f"{url}/lora-adapters")
        assert status == 200 and [(a["id"], a["path"]) for a in listed] == [(0, str(small.path)), (1, str(large.path))]

        def answer(*scales: float) -> str:
            # Every adapter's scale in every request: a request without the list reuses a prompt cache
            # computed under other scales (docs/engines.md, "LoRA adapters").
            return _text(f"{url}/v1/completions", {"prompt": "hello the fleet", "max_tokens": 12, "temperature": 0,
                                                   "lora": [{"id": i, "scale": s} for i, s in enumerate(scales)]})

        base, with_sql, with_chat = answer(0, 0), answer(1, 0), answer(0, 1)
        assert len({base, with_sql, with_chat}) == 3, (base, with_sql, with_chat)
        assert (answer(1, 0), answer(0, 0), answer(0, 1)) == (with_sql, base, with_chat)  # and again, any order
    # Its LoRA buffers are the adapters' tensors, as the planner charges them (llmgw.planner.adapters).
    logged = dict(_BUFFER.findall(log.read_text()))
    for lora in (small, large):
        planned = adapters.read(lora.path).size_bytes / MIB
        assert abs(float(logged[str(lora.path)]) - planned) <= 0.005 + 0.01 * planned, (lora.rank, logged, planned)


@pytest.mark.slow
@pytest.mark.timeout(15 * 60)  # a first install of the vLLM CPU build, then one start of 1-2 minutes
def test_vllm_loads_two_demo_adapters_at_runtime_into_one_slot_and_each_answers_its_own(tmp_path: Path) -> None:
    binary = vllm_binary()
    d = tmp_path / "tiny"
    write_demo_model(d, format="hf", context=512)
    one, two = write_demo_lora(d, "a1", format="hf", rank=8), write_demo_lora(d, "a2", format="hf", rank=8,
                                                                             targets=("q_proj", "v_proj"))
    spec = _vllm(source=str(d), max_adapters=1, max_lora_rank=8, kv_gib_per_gpu=0.0625)
    port, log = free_port(), tmp_path / "vllm.log"
    # A CPU engine's arguments, as an agent on simulated cards gives them (float32, eager, a KV cache in bytes).
    argv = engine_argv(spec, port, "127.0.0.1", {"vllm": [str(binary), "serve"]}, simulate=False, cpu=True)
    with running(argv, engine_env(spec), log, port, ready_s=300) as url:

        def answer(model: str) -> str:
            return _text(f"{url}/v1/completions", {"model": model, "prompt": "hello the fleet", "max_tokens": 8,
                                                   "temperature": 0})

        base = answer("tiny")
        for lora in (one, two):
            said = _plain(f"{url}/v1/load_lora_adapter", {"lora_name": lora.name, "lora_path": str(lora.path)})
            assert said == (200, f"Success: LoRA adapter '{lora.name}' added successfully."), said
        first, second = answer("a1"), answer("a2")  # one slot: a2 takes it from a1, then a1 takes it back
        assert len({base, first, second}) == 3, (base, first, second)
        assert answer("a1") == first
        status, listed = call(f"{url}/v1/models")
        parents = {c["id"]: c.get("parent") for c in listed["data"]}
        assert parents == {"tiny": None, "a1": "tiny", "a2": "tiny"}
        # Unloading forgets the name: a request for it is refused as vLLM refuses any model it does not serve.
        assert _plain(f"{url}/v1/unload_lora_adapter", {"lora_name": "a2"}) == (
            200, "Success: LoRA adapter 'a2' removed successfully.")
        status, refused = call(f"{url}/v1/completions", {"model": "a2", "prompt": "hi", "max_tokens": 1})
        assert status == 404 and "The model `a2` does not exist." in refused["error"]["message"]
    assert "LoRA dynamic loading & unloading is enabled" in log.read_text()
