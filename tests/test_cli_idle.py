"""``ctl idle``: what can be stopped, never an unknown, and stopping it, against a real nats-server."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import msgspec
from click.testing import CliRunner, Result
from running import until
from streams import stored

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.cli.progress import human_duration as human
from llmgw.cli.progress import parse_duration
from llmgw.config import Settings
from llmgw.errors import ServiceError
from llmgw.fleetfile import FleetNode, inventory
from llmgw.projections.runner import Projector


async def invoke(nats_url: str, *args: str) -> Result:
    return await asyncio.to_thread(CliRunner().invoke, cli, [*args, "--nats-url", nats_url], catch_exceptions=False)


async def control(bus: Bus) -> list[m.AnyEvent]:
    return await stored(bus, subjects.STREAM_CONTROL)


async def seed(bus: Bus) -> None:
    """Three replicas: idle 3 h (2 GPUs), idle 10 min, and one no router has reported."""
    now = m.utcnow()
    n = FleetNode(name="n1", fabric="f", gpu_class="H100-80GB", gpu_count=8, gpu_memory_mib=81559)
    await bus.publish(inventory(n, now - timedelta(hours=5)))
    spec = m.ModelSpec(name="qwen", source="Qwen/Qwen2.5-14B-Instruct", precision="bf16", engine="vllm",
                       gpu_class="H100-80GB", context=8192, tp=2, replicas=3)
    await bus.publish(m.ModelDeclared(at=now - timedelta(hours=5), spec=spec))
    for i in range(3):
        gpus = tuple(m.GpuRef(node="n1", index=2 * i + k, uuid=n.gpu_uuid(2 * i + k)) for k in range(2))
        await bus.publish(m.ReplicaPlaced(at=now - timedelta(hours=4), replica_id=f"qwen-r{i + 1}", model="qwen",
                                          nodes=("n1",), gpus=gpus, spec=spec, fabric="f"))
    await bus.publish(m.IdleMapPublished(at=now, router="router-1", boot_id="b", tick=9,
                                         last_request={"qwen-r1": now - timedelta(hours=3), "qwen-r2": now - timedelta(minutes=10)}))


async def test_lists_idle_and_never_unknown(bus: Bus, nats_url: str) -> None:
    await seed(bus)
    r = await invoke(nats_url, "ctl", "idle", "--older-than", "2h", "--json")
    assert r.exit_code == 0, r.output
    assert "no projector is running: replaying the streams here" in r.stderr
    data = json.loads(r.stdout)
    assert data["source"] == "replay"
    assert [x["replica_id"] for x in data["idle"]] == ["qwen-r1"]
    assert data["unknown"] == ["qwen-r3"]
    assert data["gpus_held"] == 2
    assert 6.0 <= data["gpu_hours_idle"] < 6.5  # 2 GPUs × 3 h, plus the seconds this test took
    assert data["idle"][0]["idle_s"] >= 3 * 3600

    r = await invoke(nats_url, "ctl", "idle", "--older-than", "5m")
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["replica", "model", "nodes", "GPUs", "state", "idle", "GPU-hours", "idle"]
    assert lines[1].split()[:6] == ["qwen-r1", "qwen", "n1", "2", "placed", "3h"]
    # Idle is measured against now: the seconds this test took may show (10m0s, 10m3s …).
    assert lines[2].split()[:5] == ["qwen-r2", "qwen", "n1", "2", "placed"]
    assert lines[2].split()[5].startswith("10m")
    assert "2 replicas idle ≥ 5m hold 4 GPUs" in r.stdout
    assert "1 replica with unknown idle time (no router has reported them) are not counted: qwen-r3" in r.stdout


async def test_asks_the_projector_once_it_has_caught_up(bus: Bus, nats_url: str, settings: Settings) -> None:
    await seed(bus)
    replayed = json.loads((await invoke(nats_url, "ctl", "idle", "--older-than", "5m", "--json", "--replay")).stdout)
    assert replayed["source"] == "replay"
    # A projector that follows only the fleet stream serves status but never catches up: not trusted.
    stuck = await Bus.connect(settings, "llmgw-test-stuck-projector")
    task = asyncio.create_task(Projector(stuck, streams=(subjects.STREAM_FLEET,)).run_forever())
    try:
        await until(lambda: projector_answers(bus), "the stuck projector serves status")
        r = await invoke(nats_url, "ctl", "idle", "--older-than", "5m", "--json")
        assert "does not follow LLMGW_CONTROL" in r.stderr and "replaying the streams here" in r.stderr
        assert json.loads(r.stdout)["source"] == "replay"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await stuck.close()

    live = await Bus.connect(settings, "llmgw-test-projector")
    task = asyncio.create_task(Projector(live).run_forever())
    try:
        await until(lambda: projector_answers(bus), "the projector serves status")
        r = await invoke(nats_url, "ctl", "idle", "--older-than", "5m", "--json")
        assert r.exit_code == 0 and r.stderr == ""
        asked = json.loads(r.stdout)
        # the projector's list of declared models says which names exist
        r = await invoke(nats_url, "ctl", "idle", "--model", "qwn")
        assert (r.exit_code, r.stderr) == (1, "Error: no model named 'qwn' is declared (declared: qwen); "
                                              "see `llmgw ctl model list`\n")
        r = await invoke(nats_url, "ctl", "idle", "--older-than", "5m", "--model", "qwen", "--json")
        assert [x["replica_id"] for x in json.loads(r.stdout)["idle"]] == ["qwen-r1", "qwen-r2"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await live.close()
    assert asked["source"] == "projector"
    assert [x["replica_id"] for x in asked["idle"]] == [x["replica_id"] for x in replayed["idle"]] == ["qwen-r1", "qwen-r2"]
    assert asked["unknown"] == replayed["unknown"] == ["qwen-r3"]
    assert asked["gpus_held"] == 4
    # Judged against the asker's clock, not the last event's time (which is the seed's idle map).
    assert all(a["idle_s"] >= b["idle_s"] for a, b in zip(asked["idle"], replayed["idle"], strict=True))


async def projector_answers(bus: Bus) -> bool:
    try:
        await bus.request(subjects.STATUS, m.encode(m.StatusRequest()), timeout=1)
    except ServiceError:
        return False
    return True


async def test_stop_dry_run_then_stop(bus: Bus, nats_url: str) -> None:
    await seed(bus)
    before = len(await control(bus))
    r = await invoke(nats_url, "ctl", "idle", "--older-than", "2h", "--stop", "--dry-run")
    assert r.exit_code == 0 and "would stop: qwen-r1" in r.output
    assert len(await control(bus)) == before

    r = await invoke(nats_url, "ctl", "idle", "--older-than", "2h", "--stop", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["stopped"] == ["qwen-r1"]
    stops = [e for e in await control(bus) if isinstance(e, m.ReplicaStopped)]
    assert [(e.replica_id, e.reason) for e in stops] == [("qwen-r1", "idle")]

    r = await invoke(nats_url, "ctl", "idle", "--older-than", "2h")
    assert r.stdout.startswith("no replica idle for 2h or more")


async def test_model_picks_its_replicas_and_stops_only_those(bus: Bus, nats_url: str) -> None:
    await seed(bus)
    now = m.utcnow()
    spec = m.ModelSpec(name="llama", source="meta-llama/Llama-3.1-8B-Instruct", precision="bf16", engine="vllm",
                       gpu_class="H100-80GB", context=8192)
    await bus.publish(m.ModelDeclared(at=now - timedelta(hours=5), spec=spec))
    await bus.publish(m.ModelDeclared(at=now - timedelta(hours=5), spec=msgspec.structs.replace(
        spec, name="gemma", source="google/gemma-2-9b-it")))
    await bus.publish(m.ReplicaPlaced(at=now - timedelta(hours=4), replica_id="llama-r1", model="llama", nodes=("n1",),
                                      gpus=(m.GpuRef(node="n1", index=6, uuid="GPU-n1-6"),), spec=spec, fabric="f"))
    await bus.publish(m.IdleMapPublished(at=now, router="router-1", boot_id="b", tick=10, last_request={
        "qwen-r1": now - timedelta(hours=3), "qwen-r2": now - timedelta(minutes=10),
        "llama-r1": now - timedelta(hours=4)}))
    everyone = json.loads((await invoke(nats_url, "ctl", "idle", "--older-than", "1h30m", "--json")).stdout)
    assert [x["replica_id"] for x in everyone["idle"]] == ["qwen-r1", "llama-r1"]

    r = await invoke(nats_url, "ctl", "idle", "--older-than", "1h30m", "--model", "llama", "--json")
    data = json.loads(r.stdout)
    assert (data["model"], [x["replica_id"] for x in data["idle"]], data["unknown"]) == ("llama", ["llama-r1"], [])
    assert data["older_than_s"] == 5400
    r = await invoke(nats_url, "ctl", "idle", "--model", "gemma")  # declared, nothing placed
    assert r.exit_code == 0 and r.stdout.startswith("no replica of gemma idle for 30m or more")
    r = await invoke(nats_url, "ctl", "idle", "--model", "lama")
    assert r.exit_code == 1 and r.stderr.endswith(
        "\nError: no model named 'lama' is declared (declared: gemma, llama, qwen); see `llmgw ctl model list`\n")

    r = await invoke(nats_url, "ctl", "idle", "--older-than", "2h", "--model", "llama", "--stop", "--json")
    assert json.loads(r.stdout)["stopped"] == ["llama-r1"]
    stops = [e for e in await control(bus) if isinstance(e, m.ReplicaStopped)]
    assert [e.replica_id for e in stops] == ["llama-r1"]  # qwen-r1, idle as long, is not llama's


async def test_compound_durations_read_back_what_the_tool_prints(nats_url: str) -> None:
    for seconds in (45, 1800, 5400, 7200, 3 * 86400 + 4 * 3600, 2 * 604800):
        assert parse_duration(human(seconds), "--older-than") == seconds, human(seconds)
    assert [parse_duration(x, "-") for x in ("1h30m", "2d4h", "90s", "90", "1.5h", "1w1d", " 2h 5m ")] == [
        5400, 187200, 90, 90, 5400, 691200, 7500]
    r = await invoke(nats_url, "ctl", "idle", "--older-than", "30m1h")
    assert r.exit_code == 2 and "'30m1h' repeats a unit or puts a smaller one first; write e.g. 1h30m" in r.output
    r = await invoke(nats_url, "ctl", "idle", "--older-than", "3650d1s")
    assert r.exit_code == 2 and "is longer than ten years" in r.output


async def test_bad_duration_is_a_usage_error(nats_url: str) -> None:
    r = await invoke(nats_url, "ctl", "idle", "--older-than", "soon")
    assert r.exit_code == 2 and "'soon' is not a duration" in r.output and "Traceback" not in r.output


def test_human_durations() -> None:
    assert [human(None), human(-1), human(45), human(5400), human(3 * 86400 + 4 * 3600 + 5)] == ["-", "-", "45s", "1h30m", "3d4h"]
    assert [human(0), human(7200), human(1800), human(3601)] == ["0s", "2h", "30m", "1h"]  # zero units dropped


def test_one_replica_holds_its_gpu_in_the_singular() -> None:
    """`1 replica … hold 1 GPUs` read wrong: the sentence follows its numbers."""
    from llmgw.cli.idle import summary_line

    assert summary_line(1, 1, 1800, 0.5) == "1 replica idle ≥ 30m holds 1 GPU; 0.50 GPU-hours idle"
    assert summary_line(2, 4, 300, 6.0) == "2 replicas idle ≥ 5m hold 4 GPUs; 6.00 GPU-hours idle"
