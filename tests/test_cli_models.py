"""``ctl model deploy|scale|remove`` through CliRunner against a real nats-server and planner."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner, Result
from streams import stored

from llmgw import fleetfile, subjects
from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.config import Settings
from llmgw.ctl import plan_locally
from llmgw.planner.service import PlannerService

ROOT = Path(__file__).resolve().parent.parent
FLEET = ROOT / "examples" / "fleet.toml"
MODELS = ROOT / "examples" / "models"
QWEN = "Qwen/Qwen2.5-14B-Instruct"


async def invoke(nats_url: str, *args: str) -> Result:
    """Run the CLI in a thread: it starts its own event loop, as it does for a user."""
    runner = CliRunner()
    argv = [*args, "--nats-url", nats_url]
    return await asyncio.to_thread(runner.invoke, cli, argv, catch_exceptions=False)


async def control(bus: Bus) -> list[m.AnyEvent]:
    return await stored(bus, subjects.STREAM_CONTROL)


def deploy_args(*extra: str, model: str = QWEN) -> list[str]:
    return ["ctl", "model", "deploy", "qwen", model, "--from-plan", "--fleet", str(FLEET), "--models-dir", str(MODELS), *extra]


async def test_deploy_candidate_publishes_the_planners_spec(bus: Bus, nats_url: str) -> None:
    r = await invoke(nats_url, *deploy_args("--candidate", "2", "--replicas", "2", "--idle-ttl", "2h", "--json"))
    assert r.exit_code == 0, r.output
    (declared,) = await control(bus)
    assert isinstance(declared, m.ModelDeclared)
    expected = plan_locally(QWEN, FLEET, m.PlanRequest(model=QWEN), str(MODELS)).candidates[1].spec("qwen", 2)
    assert declared.spec == msgspec.structs.replace(expected, idle_ttl_s=7200.0)
    assert declared.spec.replicas == 2
    assert json.loads(r.output)["declared"]["name"] == "qwen"


async def test_deploy_by_flags_and_human_output(bus: Bus, nats_url: str) -> None:
    r = await invoke(nats_url, *deploy_args("--precision", "bf16", "--tp", "1", "--gpu-class", "L40S-48GB", "--context", "8192"))
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"declared qwen: {QWEN} bf16 (vllm) on 1 × L40S-48GB (tp 1), context 8,192, 1 replica\n")
    (declared,) = await control(bus)
    assert isinstance(declared, m.ModelDeclared)
    assert (declared.spec.gpu_class, declared.spec.tp, declared.spec.context, declared.spec.engine) == ("L40S-48GB", 1, 8192, "vllm")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--gpu-class", "B200-192GB"), "no node has B200-192GB GPUs (classes in the fleet: A100-40GB, H100-80GB, L40S-48GB)"),
        (("--tp", "3"), "--tp 3 does not split the 40 attention heads and 8 KV heads"),
        (("--precision", "q4_K_M", "--engine", "vllm"), "precision q4_K_M is served by llama.cpp, not vllm"),
        (("--precision", "int3"), "unknown precision 'int3'"),
        (("--precision", "bf16", "--tp", "1", "--gpu-class", "H100-80GB", "@meta-llama/Llama-3.3-70B-Instruct"),
         "meta-llama/Llama-3.3-70B-Instruct at bf16, tp=1, pp=1 on H100-80GB does not fit: "),
        (("--candidate", "999"), "--candidate 999: the planner lists candidates 1 to"),
    ],
)
async def test_deploy_refusals_publish_nothing(bus: Bus, nats_url: str, extra: tuple[str, ...], message: str) -> None:
    models = [a[1:] for a in extra if a.startswith("@")]
    r = await invoke(nats_url, *deploy_args(*(a for a in extra if not a.startswith("@")), model=models[0] if models else QWEN))
    assert r.exit_code == 1
    assert r.output.startswith("Error: ") and message in r.output, r.output
    assert "Traceback" not in r.output
    assert await control(bus) == []


async def test_deploy_through_the_planner_service(bus: Bus, nats_url: str, settings: Settings) -> None:
    for inv in fleetfile.inventories(fleetfile.load(FLEET), m.utcnow()):
        await bus.publish(inv)
    planner_bus = await Bus.connect(settings, "planner")
    service = PlannerService(planner_bus, models_dir=MODELS)
    task = asyncio.create_task(service.run())
    try:
        await asyncio.wait_for(service.ready.wait(), 10)
        r = await invoke(nats_url, "ctl", "model", "deploy", "q", QWEN, "--from-plan", "--candidate", "1", "--models-dir", str(MODELS))
        assert r.exit_code == 0, r.output
        r = await invoke(nats_url, "ctl", "model", "deploy", "q", QWEN, "--from-plan", "--tp", "3", "--models-dir", str(MODELS))
        assert r.exit_code == 1 and "does not split the 40 attention heads" in r.output
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await planner_bus.close()
    events = await control(bus)
    assert [type(e).__name__ for e in events] == ["ModelDeclared"]


async def test_deploy_plans_for_the_engine_version_and_max_num_seqs_asked(bus: Bus, nats_url: str) -> None:
    """What was planned is what runs: the version and --max-num-seqs reach the plan and the declaration."""
    r = await invoke(nats_url, *deploy_args("--candidate", "1", "--engine-version", "v0.17.1", "--max-num-seqs", "64",
                                            "--json"))
    assert r.exit_code == 0, r.output
    (declared,) = await control(bus)
    assert isinstance(declared, m.ModelDeclared)
    asked = m.PlanRequest(model=QWEN, engine_version="v0.17.1", max_num_seqs=64)
    assert declared.spec == plan_locally(QWEN, FLEET, asked, str(MODELS)).candidates[0].spec("qwen")
    assert (declared.spec.engine_version, declared.spec.parallel) == ("0.17.1", 64)
    default = plan_locally(QWEN, FLEET, m.PlanRequest(model=QWEN), str(MODELS)).candidates[0].spec("qwen")
    assert (default.engine_version, default.parallel) != ("0.17.1", 64)
    r = await invoke(nats_url, *deploy_args("--candidate", "1", "--engine-version", "nightly"))
    assert r.exit_code == 1 and "Error: engine version 'nightly' has no version number" in r.output
    assert len(await control(bus)) == 1


async def test_scale_and_remove(bus: Bus, nats_url: str) -> None:
    r = await invoke(nats_url, "ctl", "model", "scale", "ghost", "--replicas", "2")
    assert r.exit_code == 1 and "no model named 'ghost' is declared (declared: none)" in r.output
    assert (await invoke(nats_url, *deploy_args("--candidate", "1"))).exit_code == 0
    r = await invoke(nats_url, "ctl", "model", "scale", "qwen", "--replicas", "3")
    assert r.exit_code == 0 and r.output == "scaled qwen to 3 replicas; watch with `llmgw ctl status`\n"
    r = await invoke(nats_url, "ctl", "model", "remove", "qwen", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["removed"] == "qwen"
    events = await control(bus)
    assert [type(e).__name__ for e in events] == ["ModelDeclared", "ModelScaled", "ModelRemoved"]
    assert isinstance(events[1], m.ModelScaled) and events[1].replicas == 3


async def test_deploy_routing_is_in_the_spec_and_changes_no_run(bus: Bus, nats_url: str) -> None:
    """--routing is the routers' business: a spec that differs only there runs as the same replicas."""
    from llmgw.scheduler.placement import same_run

    r = await invoke(nats_url, *deploy_args("--candidate", "1", "--routing", "least-outstanding"))
    assert r.exit_code == 0, r.output
    (declared,) = await control(bus)
    assert isinstance(declared, m.ModelDeclared) and declared.spec.routing == "least-outstanding"
    assert same_run(declared.spec, msgspec.structs.replace(declared.spec, routing="prefix"))
    assert not same_run(declared.spec, msgspec.structs.replace(declared.spec, context=declared.spec.context // 2))


async def test_deploy_of_another_16_bit_type_declares_it_and_show_says_so(bus: Bus, nats_url: str) -> None:
    """An fp16 plan of a bf16 checkpoint runs as fp16: the spec carries --dtype, and a changed one rolls the replicas."""
    from llmgw.scheduler.placement import same_run

    llama = "meta-llama/Llama-3.1-8B-Instruct"
    r = await invoke(nats_url, *deploy_args("--precision", "fp16", "--tp", "1", "--gpu-class", "H100-80GB", model=llama))
    assert r.exit_code == 0, r.output
    (declared,) = await control(bus)
    assert isinstance(declared, m.ModelDeclared)
    assert (declared.spec.precision, declared.spec.dtype) == ("fp16", "float16")
    assert not same_run(declared.spec, msgspec.structs.replace(declared.spec, dtype="auto"))
    r = await invoke(nats_url, "ctl", "model", "show", "qwen", "--replay")
    assert r.exit_code == 0, r.output
    runs = next(line.split(None, 1)[1] for line in r.output.splitlines() if line.strip().startswith("runs "))
    assert runs.startswith("fp16 vllm (--dtype float16), tp 1 × pp 1 ")
    # Asked again, unchanged: the dtype is what the operator's precision made it, not a figure a re-plan moves.
    r = await invoke(nats_url, *deploy_args("--precision", "fp16", "--tp", "1", "--gpu-class", "H100-80GB", model=llama))
    assert r.exit_code == 0 and r.output.startswith("unchanged qwen"), r.output
