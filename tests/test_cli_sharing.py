"""GPUs shared by memory, as the operator sees them: plan, deploy, apply, status and model show.

Declarations go through ``ctl model deploy`` and ``llmgw apply`` against a real nats-server;
the scheduler's pure ``decide`` places them on a simulated fleet of two 16 GiB cards (as
``llmgw scheduler`` would, its decisions published), and ``ctl status`` / ``ctl model show``
read the result from a replay and from a live projector alike.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner, Result
from live_projector import serving
from streams import fresh_streams, stored
from test_cli_models import FLEET, MODELS

from llmgw import fleetfile, subjects
from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.config import Settings
from llmgw.fleet.demand import SchedulerMemory
from llmgw.fleet.state import booking_mib, fold
from llmgw.scheduler import decide

QWEN3 = "Qwen/Qwen3-8B"
CARD_MIB = 16 * 1024
L4 = """\
[[nodes]]
name = "l4-1"
fabric = "pcie"
gpu_class = "L4-16GB"
gpu_count = 2
gpu_memory_mib = 16384
"""


@pytest.fixture
def l4(tmp_path: Path) -> Path:
    path = tmp_path / "l4.toml"
    path.write_text(L4)
    return path


def ctl(settings: Settings, *args: str) -> Result:
    return CliRunner().invoke(cli, [*args, "--nats-url", settings.nats_url])


def deploy(settings: Settings, name: str, fleet: Path, *extra: str) -> Result:
    return ctl(settings, "ctl", "model", "deploy", name, QWEN3, "--from-plan", "--context", "4096", "--fleet",
               str(fleet), "--models-dir", str(MODELS), *extra)


def control(settings: Settings) -> list[m.AnyEvent]:
    async def read() -> list[m.AnyEvent]:
        bus = await Bus.connect(settings, "llmgw-test-read")
        try:
            return await stored(bus, subjects.STREAM_CONTROL)
        finally:
            await bus.close()

    return asyncio.run(read())


def publish(settings: Settings, events: Sequence[m.Event], *, fresh: bool = False) -> None:
    async def go() -> None:
        bus = await Bus.connect(settings, "llmgw-test-publish")
        try:
            if fresh:
                await fresh_streams(bus)
            for e in events:
                await bus.publish(e)
        finally:
            await bus.close()

    asyncio.run(go())


def declared(settings: Settings) -> list[m.ModelSpec]:
    return [e.spec for e in control(settings) if isinstance(e, m.ModelDeclared)]


# --- plan --------------------------------------------------------------------------------------------


def test_the_plan_says_what_a_replica_books_and_that_it_shares_a_card(l4: Path) -> None:
    r = CliRunner().invoke(cli, ["ctl", "model", "plan", QWEN3, "--models-dir", str(MODELS), "--fleet", str(l4),
                                 "--context", "4096", "--precision", "q4_K_M"])
    assert r.exit_code == 0, r.output
    (row,) = [x for x in r.output.splitlines() if "q4_K_M" in x and "│" in x]
    assert row.rstrip().endswith("│            2 │ 5.80 of 16.00")
    assert ("candidate 1 needs 5.80 of 16.00 GiB on each GPU (weights + KV at its context and slots + buffers): "
            "shares a card, 10.20 GiB left beside it; deploy --exclusive takes whole GPUs, alone") in r.output
    r = CliRunner().invoke(cli, ["ctl", "model", "plan", QWEN3, "--models-dir", str(MODELS), "--fleet", str(l4),
                                 "--context", "4096", "--precision", "q4_K_M", "--json"])
    (c,) = json.loads(r.output)["candidates"]
    assert (c["booked_gib_per_gpu"], c["gpu_memory_gib"]) == (5.8, 16.0)
    # The figure is the scheduler's booking of the spec the candidate declares, not a second rule.
    spec = msgspec.convert(c, m.Candidate).spec("qwen3-8b")
    assert booking_mib(spec, CARD_MIB) == 5940 and round(5940 / 1024, 2) == c["booked_gib_per_gpu"]


def test_a_vllm_plan_books_its_utilization_of_the_card() -> None:
    r = CliRunner().invoke(cli, ["ctl", "model", "plan", QWEN3, "--models-dir", str(MODELS), "--fleet", str(FLEET),
                                 "--context", "4096", "--precision", "fp8", "--tp", "1",
                                 "--gpu-memory-utilization", "0.3", "--json"])
    assert r.exit_code == 0, r.output
    h100 = next(c for c in json.loads(r.output)["candidates"] if c["gpu_class"] == "H100-80GB")
    assert h100["booked_gib_per_gpu"] == 23.89 and h100["gpu_memory_gib"] == 79.65  # ceil(0.3 x 81,559 MiB)
    # Its KV cache is sized inside the 0.3: weights + overhead + KV is what it books, no more.
    assert h100["weights_gib_per_gpu"] + h100["overhead_gib_per_gpu"] + h100["kv_gib_per_gpu"] <= 23.9


# --- deploy ------------------------------------------------------------------------------------------


def test_deploy_exclusive_is_an_input_and_changing_it_rolls(settings: Settings, l4: Path) -> None:
    publish(settings, [], fresh=True)
    r = deploy(settings, "a", l4, "--precision", "q4_K_M")
    assert r.exit_code == 0, r.output
    assert ("  each replica books 5.80 GiB on each GPU it uses (weights + KV at its context and slots + buffers), "
            "beside other replicas that fit\n") in r.output
    r = deploy(settings, "a", l4, "--precision", "q4_K_M", "--exclusive")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == "changed a: exclusive False → True (whole GPUs, alone)"
    assert lines[2] == "  each replica takes whole GPUs, alone (exclusive)"
    assert lines[3].startswith("the scheduler rolls it: each old replica stops once a new one is healthy")
    assert [s.exclusive for s in declared(settings)] == [False, True]
    again = deploy(settings, "a", l4, "--precision", "q4_K_M", "--exclusive")
    assert again.output.startswith("unchanged a: declared as asked already; nothing published\n"), again.output
    back = deploy(settings, "a", l4, "--precision", "q4_K_M", "--json")
    assert json.loads(back.output)["changes"] == ["exclusive True → False (shares GPUs by memory)"]
    assert len(declared(settings)) == 3


def test_deploy_gpu_memory_utilization_is_the_operators_input(settings: Settings) -> None:
    """Asked for, it is no derived figure: the same deploy restarts nothing, another one rolls."""
    publish(settings, [], fresh=True)
    args = ("--precision", "fp8", "--tp", "1", "--gpu-class", "H100-80GB")
    r = deploy(settings, "v", FLEET, *args, "--gpu-memory-utilization", "0.3")
    assert r.exit_code == 0, r.output
    assert "  each replica books 0.3 of each GPU it uses (what vLLM takes), beside other replicas that fit" in r.output
    (first,) = declared(settings)
    assert first.gpu_memory_utilization == 0.3 and first.gib_per_gpu <= 0.3 * 79.65
    assert booking_mib(first, 81559) == 24468  # what the scheduler books for it on an H100
    same = deploy(settings, "v", FLEET, *args, "--gpu-memory-utilization", "0.3")
    assert same.output.startswith("unchanged v: declared as asked already; nothing published\n"), same.output
    more = deploy(settings, "v", FLEET, *args, "--gpu-memory-utilization", "0.5")
    assert more.exit_code == 0, more.output
    assert more.output.startswith("changed v: gpu_memory_utilization 0.3 → 0.5\n"), more.output
    assert "the scheduler rolls it" in more.output
    specs = declared(settings)
    assert [s.gpu_memory_utilization for s in specs] == [0.3, 0.5] and specs[1].kv_tokens > specs[0].kv_tokens
    # Without the flag the plan's own utilization is derived again: kept as declared, as any plan figure.
    plain = deploy(settings, "v", FLEET, *args)
    assert plain.output.startswith("unchanged v: declared as asked already; nothing published\n"), plain.output
    assert "gpu_memory_utilization 0.5 → 0.92" in plain.output
    assert len(declared(settings)) == 2


@pytest.mark.parametrize(("util", "words"), [
    ("0", "Invalid value for '--gpu-memory-utilization': 0.0 is not in the range 0<x<=1"),
    ("1.5", "Invalid value for '--gpu-memory-utilization': 1.5 is not in the range 0<x<=1"),
    ("nan", "--gpu-memory-utilization nan is not a fraction of the card"),
])
def test_a_utilization_that_is_no_fraction_is_a_usage_error(settings: Settings, util: str, words: str) -> None:
    publish(settings, [], fresh=True)
    r = deploy(settings, "v", FLEET, "--precision", "fp8", "--gpu-memory-utilization", util)
    assert r.exit_code == 2, r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("Error: ") and words in last and "Traceback" not in r.output
    assert control(settings) == []


def test_a_utilization_for_llama_cpp_is_refused(settings: Settings, l4: Path) -> None:
    publish(settings, [], fresh=True)
    r = deploy(settings, "a", l4, "--precision", "q4_K_M", "--gpu-memory-utilization", "0.3")
    assert r.exit_code == 1
    assert r.output == ("Error: --gpu-memory-utilization is vLLM's (the fraction of each card it takes), but the chosen "
                        "candidate runs q4_K_M on llama.cpp, which books what its plan needs on each GPU; "
                        "drop --gpu-memory-utilization, or choose a vLLM precision (--precision bf16, fp8, awq, …)\n")
    assert control(settings) == []


# --- apply -------------------------------------------------------------------------------------------

ENTRIES = """
[[model]]
name = "big"
model = "Qwen/Qwen3-8B"
precision = "fp8"
tp = 1
gpu_class = "H100-80GB"
context = 4096
exclusive = true

[[model]]
name = "small"
model = "Qwen/Qwen3-8B"
precision = "fp8"
tp = 1
gpu_class = "H100-80GB"
context = 4096
gpu_memory_utilization = {util}
"""


def apply(settings: Settings, path: Path, *extra: str) -> Result:
    return ctl(settings, "apply", str(path), "--fleet", str(FLEET), "--models-dir", str(MODELS), *extra)


def test_apply_takes_exclusive_and_gpu_memory_utilization(settings: Settings, tmp_path: Path) -> None:
    publish(settings, [], fresh=True)
    f = tmp_path / "models.toml"
    f.write_text(ENTRIES.format(util=0.3))
    r = apply(settings, f)
    assert r.exit_code == 0, r.output
    specs = {s.name: s for s in declared(settings)}
    assert (specs["big"].exclusive, specs["small"].exclusive) == (True, False)
    assert specs["small"].gpu_memory_utilization == 0.3
    again = apply(settings, f)
    assert "0 declared or changed, 2 unchanged" in again.output, again.output
    f.write_text(ENTRIES.format(util=0.4))
    changed = apply(settings, f, "--json")
    rows = {x["declared"]["name"]: x for x in json.loads(changed.output)}
    assert rows["big"]["unchanged"] and rows["small"]["changes"] == ["gpu_memory_utilization 0.3 → 0.4"]
    assert len(declared(settings)) == 3


@pytest.mark.parametrize(("value", "words"), [
    ("gpu_memory_utilization = 1.5", "Expected `float` <= 1.0"),
    ("gpu_memory_utilization = 0", "Expected `float` > 0.0"),
    ('exclusive = "yes"', "Expected `bool`, got `str` - at `$.exclusive`"),
])
def test_a_bad_sharing_key_in_a_file_is_one_error(settings: Settings, tmp_path: Path, value: str, words: str) -> None:
    publish(settings, [], fresh=True)
    f = tmp_path / "models.toml"
    f.write_text(f'[[model]]\nname = "a"\nmodel = "Qwen/Qwen3-8B"\nprecision = "fp8"\n{value}\n')
    r = apply(settings, f)
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and words in lines[0], r.output
    assert control(settings) == []


# --- status and model show ---------------------------------------------------------------------------


def shared_fleet(settings: Settings, l4: Path) -> int:
    """Two small replicas packed on one card, an exclusive one alone on the other: declared through the CLI,
    placed by the scheduler's own decision, one engine reporting its use. The events stored."""
    now = m.utcnow()
    inventories = fleetfile.inventories(fleetfile.load(l4), now)
    publish(settings, inventories, fresh=True)
    for name, extra in (("a", ()), ("b", ()), ("c", ("--exclusive",))):
        r = deploy(settings, name, l4, "--precision", "q4_K_M", *extra)
        assert r.exit_code == 0, r.output
    state = fold([*inventories, *control(settings)])
    decisions = [d.event for d in decide(state, SchedulerMemory(), now)]
    assert sorted(type(e).__name__ for e in decisions) == ["ReplicaPlaced"] * 3
    used = m.ReplicaStateChanged(at=now + timedelta(seconds=5), replica_id="a-r1", model="a", node="l4-1",
                                 state="healthy", endpoint="http://l4-1:8001", observed_memory_mib=5325)
    publish(settings, [*decisions, used])
    return len(inventories) + 3 + len(decisions) + 1


GPUS_HELD = """\
GPUs held  (GiB booked of each card, and by which replicas)

  GPU      GPU class         booked   replicas
 ────────────────────────────────────────────────────────
  l4-1:0   L4-16GB     11.6 of 16.0   a-r1 5.8, b-r1 5.8
  l4-1:1   L4-16GB     16.0 of 16.0   c-r1 16.0
"""

MEMORY = """\
Memory  (GiB of the healthy GPUs on live nodes: a GPU holds replicas while their bookings fit)

  GPU class   memory   booked            used   free   most free on one GPU
 ───────────────────────────────────────────────────────────────────────────
  L4-16GB       32.0     27.6   5.2 (engines)    4.4                    4.4
"""


def test_status_shows_who_shares_which_card_live_and_replayed(settings: Settings, l4: Path, tmp_path: Path) -> None:
    stored_events = shared_fleet(settings, l4)
    code, out = (r := ctl(settings, "ctl", "status", "--replay", "--replicas")).exit_code, r.output
    assert code == 0, out
    assert GPUS_HELD in out and MEMORY in out, out
    # Both cards hold replicas: no whole GPU is free, though one has 4.4 GiB beside a and b.
    assert "  L4-16GB         2      2      0           0      0   ████████████████████" in out
    data = json.loads(ctl(settings, "ctl", "status", "--replay", "--replicas", "--json").output)
    (cap,) = data["capacity"]
    assert {k: cap[k] for k in ("memory_mib", "booked_mib", "used_mib", "free_mib", "most_free_mib")} == {
        "memory_mib": 32768, "booked_mib": 5940 * 2 + 16384, "used_mib": 5325, "free_mib": 16384 - 5940 * 2,
        "most_free_mib": 16384 - 5940 * 2}
    assert [(b["node"], b["index"], b["replicas"]) for b in data["gpu_bookings"]] == [
        ("l4-1", 0, [["a-r1", 5940], ["b-r1", 5940]]), ("l4-1", 1, [["c-r1", 16384]])]
    with serving(settings, tmp_path / "live.duckdb", stored_events):
        live = ctl(settings, "ctl", "status", "--replicas")
        assert live.exit_code == 0, live.output
        assert live.output == out
        live_json = ctl(settings, "ctl", "status", "--replicas", "--json").output
        assert live_json == ctl(settings, "ctl", "status", "--replicas", "--json", "--replay").output


def test_model_show_states_each_replicas_booking_against_its_use(settings: Settings, l4: Path) -> None:
    shared_fleet(settings, l4)
    r = ctl(settings, "ctl", "model", "show", "a", "--replay")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert ("  booking           books 5.80 GiB on each GPU it uses (weights + KV at its context and slots + buffers), "
            "beside other replicas that fit") in lines
    (row,) = [x for x in lines if x.split()[:2] == ["a-r1", "healthy"]]
    assert "l4-1: 5.2 / 5.8 GiB" in row and " over" not in row
    c = ctl(settings, "ctl", "model", "show", "c", "--replay")
    assert "  booking           takes whole GPUs, alone (exclusive)" in c.output.splitlines()
    (row,) = [x for x in c.output.splitlines() if x.split()[:1] == ["c-r1"]]
    assert "l4-1: - / 16.0 GiB" in row  # nothing reported yet: what it booked, the whole card
    d = json.loads(ctl(settings, "ctl", "model", "show", "a", "--replay", "--json").output)
    assert [(x["booked_mib"], x["observed_memory_mib"]) for x in d["replicas"]] == [({"l4-1": 5940}, {"l4-1": 5325})]


def test_model_show_says_when_a_replica_held_more_than_it_booked(settings: Settings, l4: Path) -> None:
    shared_fleet(settings, l4)
    at = m.utcnow().replace(microsecond=0)
    publish(settings, [m.ReplicaOverBooked(at=at, replica_id="b-r1", model="b", node="l4-1", booked_mib=5940,
                                           used_mib=7168, source="rss")])
    r = ctl(settings, "ctl", "model", "show", "b", "--replay")
    assert r.exit_code == 0, r.output
    assert (f"  b-r1 held more than it booked: 7.0 GiB on l4-1 against 5.8 booked (rss, {at:%Y-%m-%d %H:%M:%S} UTC): "
            "the card's other replicas have that much less room") in r.output.splitlines()
    d = json.loads(ctl(settings, "ctl", "model", "show", "b", "--replay", "--json").output)
    assert [(x["overbooked"]["used_mib"], x["overbooked"]["source"]) for x in d["replicas"]] == [(7168, "rss")]
    a = ctl(settings, "ctl", "model", "show", "a", "--replay")
    assert "held more than it booked" not in a.output


def test_live_status_takes_used_memory_from_the_agents_nvml_samples(settings: Settings, l4: Path,
                                                                    tmp_path: Path) -> None:
    """Heartbeats are not history: live status says NVML's figure is its source, a replay the engines'."""
    stored_events = shared_fleet(settings, l4)
    beat = m.HeartbeatSent(at=m.utcnow(), node="l4-1", boot_id="b", seq=1,
                           gpus=(m.GpuSample(index=0, memory_used_mib=12_800, memory_total_mib=CARD_MIB),
                                 m.GpuSample(index=1, memory_used_mib=1_536, memory_total_mib=CARD_MIB)))

    async def send() -> None:
        bus = await Bus.connect(settings, "llmgw-test-agent")
        try:
            await bus.publish_core(subjects.heartbeat("l4-1"), m.encode(beat))
        finally:
            await bus.close()

    asyncio.run(send())
    with serving(settings, tmp_path / "live.duckdb", stored_events) as projector:
        for _ in range(400):  # bounded: until the projector has read the heartbeat
            if projector.gpu_samples is not None and projector.gpu_samples.latest:
                break
            time.sleep(0.05)
        live = ctl(settings, "ctl", "status")
    assert live.exit_code == 0, live.output
    assert "  L4-16GB       32.0     27.6   14.0 (nvml)    4.4                    4.4" in live.output, live.output
    replayed = ctl(settings, "ctl", "status", "--replay")
    assert "  L4-16GB       32.0     27.6   5.2 (engines)    4.4                    4.4" in replayed.output
