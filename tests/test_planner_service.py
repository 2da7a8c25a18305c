"""The planner service through a real nats-server: fleet published as events, plans asked over NATS."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner, Result

from llmgw import fleetfile, subjects
from llmgw import messages as m
from llmgw.agent.node import simulated_agents
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.config import Settings
from llmgw.errors import ServiceError
from llmgw.planner import modelinfo
from llmgw.planner.service import PlannerService, ask

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
MODELS = EXAMPLES / "models"
AT = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
async def service(bus: Bus, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[PlannerService]:
    """A planner following the fleet that simulated agents of the example fleet file publish."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("LLMGW_MODELS_DIR", raising=False)
    svc = PlannerService(bus, models_dir=MODELS)
    task = asyncio.create_task(svc.run())
    agents = simulated_agents(bus, fleetfile.load(EXAMPLES / "fleet.toml"), heartbeat_s=60, poll_s=60)
    runs = [asyncio.create_task(a.run()) for a in agents]
    try:
        await asyncio.wait_for(svc.ready.wait(), 15)
        await svc.wait_until(lambda state: len(state.nodes) == len(agents), 15)
        yield svc
    finally:
        for a in agents:
            a.stop()
        await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 15)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def invoke(args: list[str]) -> Result:
    """The CLI in a thread of its own: it runs its own event loop, as it does from a shell."""
    return await asyncio.to_thread(CliRunner().invoke, cli, args, catch_exceptions=False)


async def test_ctl_plan_round_trip(service: PlannerService, settings: Settings) -> None:
    assert len(service.state.nodes) == 9
    result = await invoke(["ctl", "model", "plan", "Qwen/Qwen2.5-14B-Instruct", "--nats-url", settings.nats_url,
                           "--precision", "bf16", "--precision", "Q4_K_M", "--tp", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert (data["model"], data["params"]) == ("Qwen/Qwen2.5-14B-Instruct", 14_770_033_664)
    got = {(c["gpu_class"], c["precision"]): c for c in data["candidates"]}
    assert set(got) == {(cls, p) for cls in ("A100-40GB", "H100-80GB", "L40S-48GB") for p in ("bf16", "q4_K_M")}
    h100 = got[("H100-80GB", "bf16")]
    assert (h100["fits"], h100["fabric"], h100["nodes"], h100["tp"], h100["replicas_now"]) == (True, None, 1, 1, 39)
    assert h100["command"].startswith("vllm serve Qwen/Qwen2.5-14B-Instruct --tensor-parallel-size 1")
    gguf = got[("L40S-48GB", "q4_K_M")]
    assert (gguf["engine"], gguf["file"], gguf["replicas_now"]) == ("llama.cpp", "Qwen2.5-14B-Instruct-Q4_K_M.gguf", 8)
    assert service.answered == 1


async def test_local_model_directory_travels_with_the_request(service: PlannerService, settings: Settings) -> None:
    result = await invoke(["ctl", "model", "plan", str(MODELS / "meta-llama__Llama-3.3-70B-Instruct"),
                           "--nats-url", settings.nats_url, "--precision", "bf16", "--context", "8192",
                           "--gpu-memory-utilization", "0.95"])
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert first.startswith("meta-llama/Llama-3.3-70B-Instruct: 70.55B parameters (safetensors-index)")
    assert "--tensor-parallel-size 2 --max-num-seqs 1024 --max-model-len 8192 --gpu-memory-utilization 0.95" in result.output
    assert "--tensor-parallel-size 1 " not in result.output  # it does not fit on one card


async def test_held_gpus_are_not_free(service: PlannerService, bus: Bus) -> None:
    request = m.PlanRequest(model="meta-llama/Llama-3.1-8B-Instruct", precisions=("bf16",), tp=(8,))
    before = {c.gpu_class: c.replicas_now for c in (await ask(bus, request)).candidates}
    assert before["H100-80GB"] == 4  # h100-a-03 has a bad GPU
    node = service.state.nodes["h100-a-01"]
    gpus = tuple(m.GpuRef(node=node.name, index=g.index, uuid=g.uuid) for g in node.gpus.values())
    spec = m.ModelSpec(name="big", source="x", precision="bf16", engine="vllm", gpu_class="H100-80GB", context=8192, tp=8)
    ack = await bus.publish(m.ReplicaPlaced(at=AT, replica_id="big-1", model="big", nodes=(node.name,), gpus=gpus, spec=spec))
    await service.wait_for({subjects.STREAM_CONTROL: ack.seq})
    after = {c.gpu_class: c.replicas_now for c in (await ask(bus, request)).candidates}
    assert after == {**before, "H100-80GB": 3}


async def test_bad_requests_get_error_replies_and_the_service_keeps_serving(service: PlannerService, bus: Bus) -> None:
    with pytest.raises(ServiceError, match="malformed plan request"):
        await bus.request(subjects.PLAN, b"{not json", service="planner")
    with pytest.raises(ServiceError, match="malformed plan request"):
        await bus.request(subjects.PLAN, b'{"model": 42}', service="planner")
    with pytest.raises(ServiceError, match="--tp 3 does not split"):
        await ask(bus, m.PlanRequest(model="meta-llama/Llama-3.3-70B-Instruct", tp=(3,)))
    with pytest.raises(ServiceError, match="no config.json in the Hugging Face cache"):
        await ask(bus, m.PlanRequest(model="nobody/nothing"))
    absurd = msgspec.structs.replace(modelinfo.load(str(MODELS / "Qwen__Qwen3-8B")), num_layers=10**9)
    with pytest.raises(ServiceError, match="num_layers = 1000000000 is outside"):
        await ask(bus, m.PlanRequest(model="Qwen/Qwen3-8B", info=absurd))
    reply = await ask(bus, m.PlanRequest(model="Qwen/Qwen3-8B", precisions=("bf16",), tp=(1,)))
    assert reply.candidates and all(c.fits for c in reply.candidates)


async def test_malformed_event_is_skipped_and_folding_goes_on(service: PlannerService, bus: Bus) -> None:
    await bus.publish_bytes(subjects.fleet("junk", "inventory"), b'{"type": "NodeInventoryReported"}', "junk-1")
    extra = fleetfile.parse('[[nodes]]\nname = "h200-01"\nfabric = "ib-z"\ngpu_class = "H200-141GB"\n'
                            'gpu_count = 8\ngpu_memory_mib = 143771\n')
    ack = await bus.publish(fleetfile.inventories(extra, AT)[0])
    await service.wait_for({subjects.STREAM_FLEET: ack.seq})
    assert service.skipped == 1 and "h200-01" in service.state.nodes and "junk" not in service.state.nodes
    reply = await ask(bus, m.PlanRequest(model="meta-llama/Llama-3.1-8B-Instruct", precisions=("bf16",), tp=(1,)))
    assert "H200-141GB" in {c.gpu_class for c in reply.candidates}


async def test_no_planner_running_is_a_clear_cli_error(bus: Bus, settings: Settings) -> None:
    result = await invoke(["ctl", "model", "plan", str(MODELS / "Qwen__Qwen3-8B"), "--nats-url", settings.nats_url])
    assert result.exit_code == 1
    assert result.output.startswith("Error: no planner is running on ")


async def test_planner_process_answers_and_stops_on_sigterm(bus: Bus, settings: Settings) -> None:
    """`llmgw planner` as operators run it: its own process, stopped by SIGTERM."""
    inv = fleetfile.inventories(fleetfile.load(EXAMPLES / "fleet.toml"), AT)
    await bus.publish_many(inv)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llmgw", "planner", "--nats-url", settings.nats_url,
        "--models-dir", str(MODELS), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.decode().startswith("planner answering on llmgw.plan (queue llmgw-planners) with 9 nodes folded")
        reply = await ask(bus, m.PlanRequest(model="Qwen/Qwen3-8B", precisions=("bf16",), tp=(1,)))
        assert {c.gpu_class for c in reply.candidates} == {"H100-80GB", "A100-40GB", "L40S-48GB"}
    finally:
        if proc.returncode is None:
            proc.terminate()
        code = await asyncio.wait_for(proc.wait(), 15)
    assert code == 0


async def test_an_unknown_repo_behind_a_silent_hub_is_refused_in_bounded_time_and_blocks_no_one(
    service: PlannerService, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    held: list[asyncio.StreamWriter] = []

    async def silent(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # accept, and never answer: a Hub behind a black-holing firewall

    hub = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = hub.sockets[0].getsockname()[1]
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read from the environment at import
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(modelinfo, "_probe", None)
    monkeypatch.setattr(modelinfo, "_misses", {})
    try:
        unknown = asyncio.create_task(ask(bus, m.PlanRequest(model="foo/DoesNotExist-7B"), timeout=10))
        await asyncio.sleep(0.3)  # the unknown lookup is under way in the service
        good = await ask(bus, m.PlanRequest(model="Qwen/Qwen2.5-14B-Instruct"), timeout=10)
        assert not unknown.done()  # a plan for a model on disk was answered while the Hub lookup waits
        assert good.candidates
        with pytest.raises(ServiceError, match=rf"did not answer within {modelinfo.HUB_LOOKUP_S:g}s") as first:
            await unknown
        assert "hf download foo/DoesNotExist-7B" in str(first.value)
        # Asked again, the miss is remembered: the same answer, without asking the Hub again.
        before = len(held)
        with pytest.raises(ServiceError, match="did not answer within"):
            await ask(bus, m.PlanRequest(model="foo/DoesNotExist-7B"), timeout=10)
        assert len(held) == before
    finally:
        for w in held:
            w.close()
        hub.close()


async def test_the_planner_learns_what_an_engine_on_a_real_card_reserved(service: PlannerService, bus: Bus) -> None:
    from llmgw.agent.runs import EngineConfig
    from llmgw.agent.supervisor import EngineSupervisor

    request = m.PlanRequest(model="Qwen/Qwen2.5-14B-Instruct", precisions=("bf16",), tp=(1,), context=8192)
    first = next(c for c in (await ask(bus, request)).candidates if c.gpu_class == "H100-80GB")
    assert first.observed_kv_tokens is None
    spec = first.spec("qwen")
    node = "h100-a-01"
    # A card sizes an engine's cache only on a real node: a simulated one's reservation is never learnt.
    real = msgspec.structs.replace(fleetfile.inventory(fleetfile.load(EXAMPLES / "fleet.toml").node(node), m.utcnow(),
                                                       boot_id="real-agent"), simulated=False)
    await bus.publish(real)
    await service.wait_until(lambda s: not s.nodes[node].simulated, 10)
    gpu = service.state.nodes[node].gpus[0]
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec))
    await bus.publish(m.ReplicaPlaced(at=m.utcnow(), replica_id="qwen-r1", model="qwen", nodes=(node,),
                                      gpus=(m.GpuRef(node=node, index=0, uuid=gpu.uuid),), spec=spec, fabric="ib-a"))
    outbox = bus.outbox()
    tasks = [asyncio.create_task(outbox.run()),
             asyncio.create_task(EngineSupervisor(node, EngineConfig(simulate=True, health_timeout_s=20)).run(bus, outbox))]
    try:
        await service.wait_until(lambda _: bool(service.observed), 30)
        learned = next(c for c in (await ask(bus, request)).candidates if c.gpu_class == "H100-80GB")
    finally:
        for t in reversed(tasks):
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)
    # The fake engine claimed 97% of the plan in blocks of 16; the plan now says so, and keeps its estimate.
    assert learned.observed_kv_tokens == spec.kv_tokens * 97 // 100 // 16 * 16
    assert learned.kv_tokens == learned.observed_kv_tokens and learned.estimated_kv_tokens == first.kv_tokens
    assert service.refused_observations == 0
