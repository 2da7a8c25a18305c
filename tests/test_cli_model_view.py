"""``ctl model list`` and ``ctl model show`` through CliRunner: from the projector, and replayed, alike."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner
from live_projector import publish_fresh, serving
from projection_events import T0, placed, small_fleet, t

from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.config import Settings

# A model with the plan's figures in its spec, one replica stopped this morning, and a long history.
MISTRAL = m.ModelSpec(name="mistral", source="org/mistral-24b", precision="fp8", engine="vllm", gpu_class="L40S-48GB",
                      context=16384, quantization="fp8", gib_per_gpu=42.5, kv_tokens=100_000, idle_ttl_s=7200.0)


def mistral_events() -> list[m.Event]:
    flaps = [m.ReplicaStateChanged(at=t(32 + i), replica_id="mistral-r2", model="mistral", node="n4",
                                   state="healthy" if i % 2 == 0 else "unhealthy", restarts=i // 2,
                                   endpoint="http://n4:8001", observed_kv_tokens=96_000 if i % 2 == 0 else 0,
                                   observed_memory_mib=40_960 if i % 2 == 0 else 0)
             for i in range(21)]
    return [
        m.ModelDeclared(at=T0 - timedelta(hours=12), spec=MISTRAL),  # 22:00 the day before
        placed("mistral-r1", MISTRAL, [("n4", 1)], T0 - timedelta(hours=11), fabric="pcie"),  # 23:00
        m.ReplicaStopped(at=T0 - timedelta(hours=9), replica_id="mistral-r1", model="mistral", reason="idle"),  # 01:00
        placed("mistral-r2", MISTRAL, [("n4", 1)], t(30), fabric="pcie"),
        m.ReplicaStateChanged(at=t(31), replica_id="mistral-r2", model="mistral", node="n4", state="starting"),
        *flaps,
    ]


def with_real_n4(events: list[m.Event]) -> list[m.Event]:
    """n4 reported by a real agent: its card sized what mistral's engine reserved."""
    return [msgspec.structs.replace(e, simulated=False) if isinstance(e, m.NodeInventoryReported) and e.node == "n4"
            else e for e in events]


EVENTS = [*with_real_n4(small_fleet()), *mistral_events()]


@pytest.fixture
def fleet(settings: Settings) -> Settings:
    asyncio.run(publish_fresh(settings, EVENTS))
    return settings


@pytest.fixture
def live_projector(fleet: Settings, tmp_path: Path) -> Iterator[Settings]:
    with serving(fleet, tmp_path / "live.duckdb", len(EVENTS)):
        yield fleet


def ctl(settings: Settings, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["ctl", "model", *args, "--nats-url", settings.nats_url])
    return result.exit_code, result.output


def test_model_list_json_live_equals_replay(live_projector: Settings) -> None:
    code, live = ctl(live_projector, "list", "--json")
    assert code == 0, live
    code, replayed = ctl(live_projector, "list", "--json", "--replay")
    assert code == 0, replayed
    assert live == replayed
    rows = {r["name"]: r for r in json.loads(live)}
    assert list(rows) == ["deepseek-v3", "gemma-9b", "llama-70b", "mistral", "qwen-8b"]
    mistral = rows["mistral"]
    assert {k: mistral[k] for k in ("state", "healthy", "placed", "wanted", "source", "precision", "engine",
                                    "quantization", "tp", "pp", "gpus_per_replica", "gpu_class", "gpus_held")} == {
        "state": "serving", "healthy": 1, "placed": 1, "wanted": 1, "source": "org/mistral-24b", "precision": "fp8",
        "engine": "vllm", "quantization": "fp8", "tp": 1, "pp": 1, "gpus_per_replica": 1, "gpu_class": "L40S-48GB",
        "gpus_held": 1}
    # 01:00 to 11:40 today: mistral-r1 from midnight to its stop (1 h), mistral-r2 since 10:30 (70 min).
    assert mistral["gpu_hours_today"] == 2.167
    assert (mistral["kv_tokens_planned"], mistral["kv_tokens_observed"]) == (100_000, 96_000)
    assert mistral["idle_s"] == -1.0  # no router knows: unknown, not idle
    assert rows["qwen-8b"]["idle_s"] == 5520.0 and rows["qwen-8b"]["idle_since"] == "2026-03-02T10:08:00Z"
    # llama-70b: 8 GPUs since 10:04.
    assert rows["llama-70b"]["gpu_hours_today"] == 12.8 and (rows["llama-70b"]["tp"], rows["llama-70b"]["pp"]) == (4, 2)
    assert rows["deepseek-v3"]["unplaceable"].startswith("needs 4 whole H100-80GB nodes")


LIST = """\
replicas healthy/wanted · split tp×pp (pp nodes per replica) · GPU-hours held today (UTC) · KV cache tokens reserved / planned

  model         state         replicas   source            runs        split   GPU class    idle   GPU-h   KV obs / plan
 ───────────────────────────────────────────────────────────────────────────────────────────────────────────────────────────────────
  deepseek-v3   unplaceable        0/1   org/deepseek-v3   bf16 vllm   8×4     H100-80GB       -    0.00   -
  gemma-9b      starting           0/1   org/gemma-9b      bf16 vllm   1×1     L40S-48GB       -    1.60   -
  llama-70b     serving            1/1   org/llama-70b     bf16 vllm   4×2     H100-80GB      5m   12.80   -
  mistral       serving            1/1   org/mistral-24b   fp8 vllm    1×1     L40S-48GB       -    2.17   96,000 / 100,000 (-4.2%)
  qwen-8b       serving            1/1   org/qwen-8b       bf16 vllm   1×1     H100-80GB   1h32m    1.60   -

deepseek-v3: needs 4 whole H100-80GB nodes on one fabric; ib-a has 0 free, ib-b 0
mistral: fixed, idle ttl 2h
"""


def test_model_list_table(live_projector: Settings) -> None:
    assert ctl(live_projector, "list") == (0, LIST)


def test_model_show_json_live_equals_replay(live_projector: Settings) -> None:
    code, live = ctl(live_projector, "show", "mistral", "--json")
    assert code == 0, live
    code, replayed = ctl(live_projector, "show", "mistral", "--json", "--replay")
    assert code == 0, replayed
    assert live == replayed
    d = json.loads(live)
    assert d["positions"] == {"LLMGW_CONTROL": 12 + 26, "LLMGW_FLEET": 7, "LLMGW_USAGE": 4}
    assert d["spec"]["gib_per_gpu"] == 42.5 and d["spec"]["kv_tokens"] == 100_000
    (r,) = d["replicas"]
    assert {k: r[k] for k in ("replica_id", "state", "nodes", "fabric", "endpoint", "restarts", "idle_s",
                              "kv_tokens_planned", "kv_tokens_observed", "kv_error")} == {
        "replica_id": "mistral-r2", "state": "healthy", "nodes": ["n4"], "fabric": "pcie",
        "endpoint": "http://n4:8001", "restarts": 10, "idle_s": -1.0, "kv_tokens_planned": 100_000,
        "kv_tokens_observed": 96_000, "kv_error": 0.0417}
    assert r["gpus"] == [{"node": "n4", "index": 1, "uuid": "GPU-n4-1", "mib": 0}]  # 0: placed as a whole card
    assert r["observed_memory_mib"] == {"n4": 40_960}  # NVML, as its agent read it
    # The latest 20 of its 26 control events, oldest first: the declaration and both placements are older.
    seqs = [e["seq"] for e in d["events"]]
    assert seqs == list(range(12 + 7, 12 + 27))
    assert {e["event"]["type"] for e in d["events"]} == {"ReplicaStateChanged"}
    assert d["events"][-1]["event"]["restarts"] == 10


def test_model_show_table(live_projector: Settings) -> None:
    code, out = ctl(live_projector, "show", "mistral")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == ("mistral: serving · 1/1 healthy (1 placed; 1 replica wanted, set by declared) · idle - · "
                        "2.17 GPU-hours today")
    assert "  runs        fp8 vllm, tp 1 × pp 1 = 1 GPU per replica (1 node) of L40S-48GB" in lines
    assert "  memory per GPU    42.50 GiB (weights, overhead and KV cache) at gpu_memory_utilization 0.9" in lines
    assert "  KV cache          100,000 tokens per replica (KV dtype auto)" in lines
    assert "  booking           books 0.9 of each GPU it uses (what vLLM takes), beside other replicas that fit" in lines
    # Placed before GPUs were shared: it booked the whole 45 GiB card, of which its engine holds 40.
    assert any(x.split()[:3] == ["mistral-r2", "healthy", "n4"] and "n4: 40.0 / 45.0 GiB" in x for x in lines)
    assert any(x.split()[:3] == ["mistral-r2", "healthy", "n4"] and "n4:1 GPU-n4-1" in x and "(-4.2%)" in x for x in lines)
    assert "Events (the latest 20, oldest first; `llmgw replay --model mistral` for all)" in lines
    assert lines[-1].split()[:4] == ["38", "2026-03-02", "10:52:00", "replica"]


def test_model_show_a_multi_node_replica_lists_every_gpu(fleet: Settings) -> None:
    code, out = ctl(fleet, "show", "llama-70b", "--replay", "--json")
    assert code == 0, out
    (r,) = json.loads(out)["replicas"]
    assert [(g["node"], g["index"]) for g in r["gpus"]] == [("n2", i) for i in range(4)] + [("n3", i) for i in range(4)]
    assert [e["event"]["type"] for e in json.loads(out)["events"]] == [
        "ModelDeclared", "ReplicaPlaced", "ReplicaStateChanged", "ReplicaStateChanged"]


def test_model_show_unknown_name_lists_the_declared(fleet: Settings) -> None:
    code, out = ctl(fleet, "show", "mistrall", "--replay")
    assert code == 1
    assert out == ("Error: no model named 'mistrall' is declared (declared: deepseek-v3, gemma-9b, llama-70b, mistral, "
                   "qwen-8b); see `llmgw ctl model list`, or deploy it with `llmgw ctl model deploy NAME MODEL "
                   "--from-plan`\n")


def test_model_list_without_a_projector_replays_here(fleet: Settings) -> None:
    result = CliRunner().invoke(cli, ["ctl", "model", "list", "--json", "--nats-url", fleet.nats_url])
    assert result.exit_code == 0, result.output
    assert "no projector is running: replaying the streams here" in result.stderr
    assert [r["name"] for r in json.loads(result.stdout)] == ["deepseek-v3", "gemma-9b", "llama-70b", "mistral", "qwen-8b"]


def test_model_show_after_more_events_reads_them_too(live_projector: Settings) -> None:
    """The status service reads the control stream on from where its last answer stopped."""
    assert ctl(live_projector, "show", "mistral", "--json")[0] == 0
    more = [m.ModelScaled(at=t(101), name="mistral", replicas=2),
            placed("mistral-r3", MISTRAL, [("n1", 1)], t(102), fabric="ib-a")]

    async def publish() -> None:
        bus = await Bus.connect(live_projector, "llmgw-test-more")
        try:
            for e in more:
                await bus.publish(e)
        finally:
            await bus.close()

    asyncio.run(publish())
    code, live = ctl(live_projector, "show", "mistral", "--json")
    assert code == 0, live
    assert ctl(live_projector, "show", "mistral", "--json", "--replay") == (0, live)
    d = json.loads(live)
    assert [e["seq"] for e in d["events"]][-2:] == [39, 40]
    assert (d["summary"]["wanted"], d["summary"]["placed"], d["summary"]["state"]) == (2, 2, "serving")


def test_model_show_states_used_gpu_memory_against_what_was_booked() -> None:
    from llmgw.cli.models import memory_text

    row = m.ReplicaRow(replica_id="x-r1", model="x", state="healthy", nodes=("a", "b"),
                       gpus=tuple(m.GpuRef(node=n, index=i, uuid=f"{n}{i}", mib=43_520) for n in "ab" for i in range(2)),
                       fabric="ib", endpoint="", restarts=0, detail="", placed_at=None, state_at=None, idle_s=-1,
                       idle_since=None, kv_tokens_planned=0, kv_tokens_observed=0,
                       observed_memory_mib={"a": 81_920, "b": 97_280}, booked_mib={"a": 87_040, "b": 87_040})
    # b's engine holds 11.8 % over what it booked on b: more than the margin, its neighbours' room.
    assert memory_text(row) == "a: 80.0 / 85.0 GiB\nb: 95.0 / 85.0 GiB over"
    assert memory_text(msgspec.structs.replace(row, observed_memory_mib={})) == "a: - / 85.0 GiB\nb: - / 85.0 GiB"
    assert memory_text(msgspec.structs.replace(row, observed_memory_mib={}, booked_mib={})) == "-"


def test_model_show_states_each_replicas_cached_share() -> None:
    from llmgw.cli.models import cached_text

    row = m.ReplicaRow(replica_id="x-r1", model="x", state="healthy", nodes=("a",), gpus=(), fabric="ib",
                       endpoint="", restarts=0, detail="", placed_at=None, state_at=None, idle_s=-1,
                       idle_since=None, kv_tokens_planned=0, kv_tokens_observed=0,
                       prompt_tokens=1_234_567, cached_tokens=1_037_036)
    assert cached_text(row) == "84% of 1.2M"
    assert cached_text(msgspec.structs.replace(row, prompt_tokens=0, cached_tokens=0)) == "-"


def test_what_a_card_did_not_size_is_shown_as_reported_never_against_the_plan(settings: Settings) -> None:
    """vLLM on a CPU box (a simulated node) sizes its cache from VLLM_CPU_KVCACHE_SPACE: 524,288 tokens
    said nothing of the 15,052,368 the plan gave the simulated card; shown as +2771.0% before."""
    qwen = m.ModelSpec(name="qwen-cpu", source="Qwen/Qwen2.5-0.5B-Instruct", precision="bf16", engine="vllm",
                       gpu_class="H100-80GB", context=4096, kv_tokens=15_052_368)
    events: list[m.Event] = [
        m.NodeInventoryReported(at=t(0), node="cpu1", fabric="cpu1", fabric_source="default", boot_id="b1",
                                simulated=True, gpus=(m.GpuInfo(index=0, uuid="GPU-cpu1-0", name="NVIDIA H100 80GB HBM3",
                                                                gpu_class="H100-80GB", memory_mib=81559),)),
        m.ModelDeclared(at=t(1), spec=qwen),
        placed("qwen-cpu-r1", qwen, [("cpu1", 0)], t(2), fabric="cpu1"),
        m.ReplicaStateChanged(at=t(3), replica_id="qwen-cpu-r1", model="qwen-cpu", node="cpu1", state="healthy",
                              endpoint="http://127.0.0.1:8001", observed_kv_tokens=524_288),
    ]
    asyncio.run(publish_fresh(settings, events))
    code, out = ctl(settings, "show", "qwen-cpu", "--replay")
    assert code == 0, out
    assert "  observed          - (no engine whose card sized its cache has reported what it reserved)" in out
    # The replica's own report, as such (the table folds it over lines), and no ratio anywhere.
    flat = " ".join(out.split())  # where the table folds it moves with the columns' widths
    assert "524,288 /" in out and "(not" in out and "sized by its" in out and "card)" in flat and "%)" not in out
    code, out = ctl(settings, "show", "qwen-cpu", "--replay", "--json")
    d = json.loads(out)
    assert d["summary"]["kv_tokens_observed"] == 0
    assert [(r["kv_tokens_observed"], r["kv_error"]) for r in d["replicas"]] == [(524_288, None)]
