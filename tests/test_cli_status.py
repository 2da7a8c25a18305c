"""``llmgw ctl status`` through CliRunner: the exact table and JSON a user sees, live and replayed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner
from live_projector import publish_fresh, serving
from projection_events import inventory, placed, small_fleet, spec, t
from streams import fresh_streams

from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.cli.status import usage_bar
from llmgw.config import Settings

TABLE = """\
Fleet at 2026-03-02 11:40:00 UTC  [control:12 fleet:7 usage:4]
5 nodes (1 lost: n5) · 4 models · 3 replicas (2 healthy, 1 starting) · 0 unprojected events
node n1: 1 GPU fault in 24h (placement prefers nodes with fewer)
models: 2 serving (llama-70b, qwen-8b), 1 starting (gemma-9b), 1 unplaceable (deepseek-v3)

Models  (replicas healthy/wanted; idle: since anyone asked, - = no router knows)

  model         state         replicas   per replica                      GPUs held    idle
 ───────────────────────────────────────────────────────────────────────────────────────────
  deepseek-v3   unplaceable        0/1   32 × H100-80GB (bf16, 4 nodes)           0       -
  gemma-9b      starting           0/1   1 × L40S-48GB (bf16, 1 node)             1       -
  llama-70b     serving            1/1   8 × H100-80GB (bf16, 2 nodes)            8      5m
  qwen-8b       serving            1/1   1 × H100-80GB (bf16, 1 node)             1   1h32m

Capacity  (whole GPUs: █ holding a replica  ░ free  x unhealthy  ? lost)

  GPU class   total   used   free   unhealthy   lost   usage
 ───────────────────────────────────────────────────────────────────────────
  H100-80GB      16      9      2           1      4   ███████████░░░x?????
  L40S-48GB       2      1      1           0      0   ██████████░░░░░░░░░░

Memory  (GiB of the healthy GPUs on live nodes: a GPU holds replicas while their bookings fit)

  GPU class   memory   booked   used    free   most free on one GPU
 ───────────────────────────────────────────────────────────────────
  H100-80GB    876.1    716.8      -   159.3                   79.6
  L40S-48GB     90.0     45.0      -    45.0                   45.0

Free whole nodes (every GPU healthy and free; what a multi-node replica needs)

  fabric   GPU class   free   live
 ──────────────────────────────────
  ib-a     H100-80GB      0      3
  ib-b     H100-80GB      0      0
  pcie     L40S-48GB      0      1

Unplaceable models

  model         since                 reason
 ──────────────────────────────────────────────────────────────────────────────────────────────────────────
  deepseek-v3   2026-03-02 10:05:00   needs 4 whole H100-80GB nodes on one fabric; ib-a has 0 free, ib-b 0

Replicas nobody asked for (idle ≥ 30m; - = no router knows)

  replica   model      GPUs   nodes   state       idle
 ──────────────────────────────────────────────────────
  r-qwen    qwen-8b       1   n1      healthy    1h32m
  r-gemma   gemma-9b      1   n4      starting       -
"""


@pytest.fixture
def fleet(settings: Settings) -> Settings:
    asyncio.run(publish_fresh(settings, small_fleet()))
    return settings


@pytest.fixture
def live_projector(fleet: Settings, tmp_path: Path) -> Iterator[Settings]:
    """A projector serving status from its own thread and loop, caught up with the streams."""
    with serving(fleet, tmp_path / "live.duckdb", len(small_fleet())):
        yield fleet


def _status(settings: Settings, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["ctl", "status", "--nats-url", settings.nats_url, *args])
    return result.exit_code, result.output


def test_status_right_after_a_burst_reads_its_own_writes(live_projector: Settings) -> None:
    # Health flips on a known GPU, published just before asking: no sleep, no poll.
    at = datetime(2026, 3, 2, 11, 41, tzinfo=UTC)
    burst = [m.GpuHealthChanged(at=at + timedelta(milliseconds=i), node="n1", gpu_index=0, gpu_uuid="GPU-n1-0",
                                healthy=i % 2 == 1, reasons=() if i % 2 else (f"xid {i}",)) for i in range(4001)]

    async def publish() -> None:
        bus = await Bus.connect(live_projector, "llmgw-test-burst")
        try:
            await bus.publish_many(burst)
        finally:
            await bus.close()

    asyncio.run(publish())
    code, live = _status(live_projector, "--json")
    assert code == 0, live
    code, replayed = _status(live_projector, "--json", "--replay")
    assert code == 0, replayed
    assert live == replayed
    assert json.loads(live)["positions"]["LLMGW_FLEET"] >= len(burst)


def test_status_table_from_a_replay(fleet: Settings) -> None:
    code, out = _status(fleet, "--replay")
    assert (code, out) == (0, TABLE)


def test_status_json_live_equals_replay(live_projector: Settings) -> None:
    code, live = _status(live_projector, "--json")
    assert code == 0, live
    code, replayed = _status(live_projector, "--json", "--replay")
    assert code == 0, replayed
    assert live == replayed
    data = json.loads(live)
    # Nine whole cards held (placed before sharing: each books its card), two left whole; n1's XID'd GPU and
    # lost n5 count in no memory.
    card = 81559
    assert data["capacity"][0] == {"gpu_class": "H100-80GB", "total": 16, "used": 9, "free": 2, "unhealthy": 1, "lost": 4,
                                   "memory_mib": 11 * card, "booked_mib": 9 * card, "free_mib": 2 * card,
                                   "most_free_mib": card, "used_mib": None}
    assert [(i["replica_id"], i["idle_s"], i["gpus"]) for i in data["idle"]] == [("r-qwen", 5520.0, 1), ("r-gemma", -1.0, 1)]
    assert data["free_nodes"][0] == {"fabric": "ib-a", "gpu_class": "H100-80GB", "free_nodes": 0, "live_nodes": 3}
    assert [u["name"] for u in data["unplaceable"]] == ["deepseek-v3"]
    assert (data["lost_nodes"], data["unprojected_events"], data["replicas"]) == (["n5"], 0, 3)


def test_status_table_live(live_projector: Settings) -> None:
    assert _status(live_projector) == (0, TABLE)


REPLICAS = """\
Replicas (3; idle - = no router knows)

  replica   model       state      GPUs            fabric   endpoint         restarts    idle
 ─────────────────────────────────────────────────────────────────────────────────────────────
  r-gemma   gemma-9b    starting   n4:0            pcie     -                       0       -
  r-llama   llama-70b   healthy    n2:0-3 n3:0-3   ib-a     http://n2:8000          0      5m
  r-qwen    qwen-8b     healthy    n1:0            ib-a     http://n1:8000          0   1h32m

GPUs held  (GiB booked of each card, and by which replicas)

  GPU    GPU class         booked   replicas
 ────────────────────────────────────────────────
  n1:0   H100-80GB   79.6 of 79.6   r-qwen 79.6
  n2:0   H100-80GB   79.6 of 79.6   r-llama 79.6
  n2:1   H100-80GB   79.6 of 79.6   r-llama 79.6
  n2:2   H100-80GB   79.6 of 79.6   r-llama 79.6
  n2:3   H100-80GB   79.6 of 79.6   r-llama 79.6
  n3:0   H100-80GB   79.6 of 79.6   r-llama 79.6
  n3:1   H100-80GB   79.6 of 79.6   r-llama 79.6
  n3:2   H100-80GB   79.6 of 79.6   r-llama 79.6
  n3:3   H100-80GB   79.6 of 79.6   r-llama 79.6
  n4:0   L40S-48GB   45.0 of 45.0   r-gemma 45.0

Replicas nobody asked for"""


def test_status_replicas_table_live_and_replayed(live_projector: Settings) -> None:
    code, live = _status(live_projector, "--replicas")
    assert code == 0, live
    assert REPLICAS in live
    assert _status(live_projector, "--replicas", "--replay") == (0, live)
    # Without the flag, no replica table.
    assert "Replicas (3;" not in _status(live_projector)[1]


def test_status_json_with_replicas_live_equals_replay(live_projector: Settings) -> None:
    code, live = _status(live_projector, "--json", "--replicas")
    assert code == 0, live
    assert _status(live_projector, "--json", "--replicas", "--replay") == (0, live)
    data = json.loads(live)
    rows = {r["replica_id"]: r for r in data["replica_list"]}
    assert list(rows) == ["r-gemma", "r-llama", "r-qwen"]
    assert {k: rows["r-qwen"][k] for k in ("model", "state", "nodes", "fabric", "endpoint", "idle_s", "idle_since")} == {
        "model": "qwen-8b", "state": "healthy", "nodes": ["n1"], "fabric": "ib-a", "endpoint": "http://n1:8000",
        "idle_s": 5520.0, "idle_since": "2026-03-02T10:08:00Z"}
    assert rows["r-gemma"]["idle_s"] == -1.0 and rows["r-gemma"]["idle_since"] is None
    assert [g["uuid"] for g in rows["r-llama"]["gpus"]] == [f"GPU-n{n}-{i}" for n in (2, 3) for i in range(4)]
    models = {x["name"]: x for x in data["model_list"]}
    assert {n: (x["state"], x["healthy"], x["wanted"], x["gpus_held"]) for n, x in models.items()} == {
        "deepseek-v3": ("unplaceable", 0, 1, 0), "gemma-9b": ("starting", 0, 1, 1), "llama-70b": ("serving", 1, 1, 8),
        "qwen-8b": ("serving", 1, 1, 1)}
    # Without the flag the list is left out (it grows with the fleet); the models are always there.
    code, plain = _status(live_projector, "--json")
    assert json.loads(plain)["replica_list"] == [] and json.loads(plain)["model_list"] == data["model_list"]


@pytest.mark.parametrize(
    ("total", "used", "free", "unhealthy", "lost", "bar"),
    [
        (40, 1, 39, 0, 0, "█" + "░" * 19),  # rounds to 0 cells: still one
        (40, 0, 39, 1, 0, "░" * 19 + "x"),
        (40, 0, 38, 1, 1, "░" * 18 + "x?"),
        (1000, 998, 1, 1, 0, "█" * 18 + "░x"),  # the room for the others comes from the most
        (40, 39, 0, 1, 0, "█" * 19 + "x"),
        (16, 9, 2, 1, 4, "███████████░░░x?????"),
        (2, 1, 1, 0, 0, "█" * 10 + "░" * 10),
        (3, 1, 1, 1, 0, "█" * 7 + "░" * 6 + "x" * 7),
        (0, 0, 0, 0, 0, ""),
    ],
)
def test_usage_bar_never_hides_a_used_or_unhealthy_gpu(total: int, used: int, free: int, unhealthy: int, lost: int,
                                                       bar: str) -> None:
    c = m.ClassCapacity(gpu_class="H100-80GB", total=total, used=used, free=free, unhealthy=unhealthy, lost=lost)
    assert usage_bar(c) == bar
    assert len(bar) in (0, 20)


def test_status_counts_read_in_the_singular(settings: Settings) -> None:
    one = spec("solo")
    events = [inventory("n1", "ib-a", 1, t(0)), m.ModelDeclared(at=t(1), spec=one),
              placed("r-solo", one, [("n1", 0)], t(2)),
              m.ReplicaStateChanged(at=t(3), replica_id="r-solo", model="solo", node="n1", state="healthy")]
    asyncio.run(publish_fresh(settings, events))
    code, out = _status(settings, "--replay", "--replicas")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[1] == "1 node · 1 model · 1 replica (1 healthy) · 0 unprojected events"
    assert any(x.split() == ["solo", "serving", "1/1", "1", "×", "H100-80GB", "(bf16,", "1", "node)", "1", "-"] for x in lines)
    assert "Replicas (1; idle - = no router knows)" in lines


def test_status_at_a_past_moment(settings: Settings) -> None:
    """``--at`` cuts each stream at the last message the server stored by then."""

    async def two_phases() -> datetime:
        bus = await Bus.connect(settings, "llmgw-test-cli")
        try:
            await fresh_streams(bus)
            events = small_fleet()
            for event in events[:11]:  # inventories, health, the lost node, four declared models
                await bus.publish(event)
            await asyncio.sleep(0.05)
            between = datetime.now(UTC)
            await asyncio.sleep(0.05)
            for event in events[11:]:
                await bus.publish(event)
            return between
        finally:
            await bus.close()

    between = asyncio.run(two_phases())
    code, out = _status(settings, "--json", "--at", between.isoformat())
    assert code == 0, out
    data = json.loads(out)
    assert (data["replicas"], data["models"], data["idle"]) == (0, 4, [])
    assert data["positions"] == {"LLMGW_CONTROL": 4, "LLMGW_FLEET": 7}
    assert data["capacity"][0]["used"] == 0 and data["capacity"][0]["free"] == 11
    assert data["now"] == between.isoformat().replace("+00:00", "Z")


def test_status_at_seq(fleet: Settings) -> None:
    # control:9 is r-llama's head part turning healthy; its second node's part has not said so yet.
    code, out = _status(fleet, "--json", "--at-seq", "control:9")
    assert code == 0, out
    data = json.loads(out)
    assert data["positions"] == {"LLMGW_CONTROL": 9, "LLMGW_FLEET": 7}
    assert data["replicas"] == 3 and data["replicas_by_state"] == {"starting": 1, "placed": 2}
    # control:10: both parts healthy, so the replica is.
    code, out = _status(fleet, "--json", "--at-seq", "control:10")
    assert code == 0, out
    assert json.loads(out)["replicas_by_state"] == {"healthy": 1, "placed": 2}
    assert data["unplaceable"][0]["name"] == "deepseek-v3"


def test_status_idle_threshold(fleet: Settings) -> None:
    code, out = _status(fleet, "--json", "--replay", "--idle-threshold", "2h")
    assert code == 0, out
    # r-qwen is idle 1h32m; r-gemma, unknown to every router, was placed 1h36m before: not yet 2 h either.
    assert [i["replica_id"] for i in json.loads(out)["idle"]] == []
    code, out = _status(fleet, "--json", "--replay", "--idle-threshold", "1h")
    assert [i["replica_id"] for i in json.loads(out)["idle"]] == ["r-qwen", "r-gemma"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--idle-threshold", "soon"], "'soon' is not a duration"),
        (["--at", "yesterday-ish"], "is not a time"),
        (["--at-seq", "fleet"], "is not STREAM:SEQ"),
        (["--at-seq", "heartbeat:3"], "is not a history stream"),
        (["--at-seq", "fleet:999"], "there is no LLMGW_FLEET:999"),
        (["--at", "1h", "--at-seq", "fleet:1"], "give --at or --at-seq, not both"),
    ],
)
def test_status_mistakes_are_errors_not_tracebacks(fleet: Settings, args: list[str], message: str) -> None:
    code, out = _status(fleet, *args)
    assert code in (1, 2) and message in out and "Traceback" not in out


def test_status_without_a_projector_says_what_to_do(fleet: Settings) -> None:
    code, out = _status(fleet)
    assert code == 1
    assert "Error: no projector (status service; run `llmgw project` or use --replay) is running" in out


def test_the_capacity_tables_say_what_the_gpus_are_doing_when_agents_sampled_them() -> None:
    from llmgw.cli.status import used_cell, util_cell

    use = m.ClassGpuUse(gpu_class="H100-80GB", sampled=16, utilization_pct=62.6, memory_used_mib=700 * 1024,
                        memory_total_mib=1280 * 1024)
    cap = m.ClassCapacity(gpu_class="H100-80GB", total=16, used=4, free=12, unhealthy=0, memory_mib=1280 * 1024,
                          booked_mib=320 * 1024, free_mib=960 * 1024, most_free_mib=80 * 1024, used_mib=300 * 1024)
    assert util_cell(use) == "63%"
    assert util_cell(msgspec.structs.replace(use, utilization_pct=None)) == "-"
    assert util_cell(None) == "-"  # a class no agent sampled (or a replay)
    # Used: NVML's samples where the agents sent them, else what the engines report, else nothing known.
    assert used_cell(cap, use) == "700.0 (nvml)"
    assert used_cell(cap, None) == "300.0 (engines)"
    assert used_cell(msgspec.structs.replace(cap, used_mib=None), None) == "-"
