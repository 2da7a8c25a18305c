"""Four findings of an attacker's run, each reproduced before it was fixed (docs/reliability.md).

``ctl status --at`` a moment that never was in the history; a model name the Hugging
Face Hub refuses; a GPU class or fabric of any characters in an event; a healthy
report that clears another model's failure back-off (in test_scheduler.py).
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner, Result
from live_projector import publish_fresh
from projection_events import inventory, placed, small_fleet, spec, t

from llmgw import fleetfile, subjects
from llmgw import messages as m
from llmgw.agent.node import detect_fabric
from llmgw.agent.nvml import GpuStatic, gpu_class
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.config import Settings
from llmgw.errors import FleetFileError, ModelError
from llmgw.fleet.replay import replay
from llmgw.planner import modelinfo

ROOT = Path(__file__).resolve().parent.parent
FLEET = ROOT / "examples" / "fleet.toml"
MODELS = ROOT / "examples" / "models"
NO_NATS = "nats://127.0.0.1:1"


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def one_error(r: Result, *words: str) -> str:
    """Exit 1 and one line ``Error: …`` holding ``words``: what a person can act on, no traceback."""
    assert r.exit_code == 1, r.output
    assert isinstance(r.exception, SystemExit), repr(r.exception)
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and all(w in lines[0] for w in words), r.output
    return lines[0]


# --- 1. ctl status --at a moment outside the history ---------------------------------------------


@pytest.mark.parametrize("at", ["9999-12-31", "2999-01-01T00:00", "+1h"])
def test_status_at_a_moment_in_the_future_is_one_error(at: str) -> None:
    """Before: accepted, and the fleet "at" 9999-12-31 was today's with every replica idle 2912107d."""
    if at == "+1h":
        at = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    line = one_error(invoke("ctl", "status", "--at", at, "--nats-url", NO_NATS), "--at", "in the future",
                     "leave --at out")
    assert "cannot reach NATS" not in line  # refused before connecting


def test_status_at_a_moment_within_the_clock_allowance_is_not_refused() -> None:
    """A clock a little ahead of the server's is not a mistake: it gets as far as asking NATS."""
    r = invoke("ctl", "status", "--at", (datetime.now(UTC) + timedelta(minutes=1)).isoformat(), "--nats-url", NO_NATS)
    one_error(r, "cannot reach NATS")


@pytest.mark.parametrize("at", ["1999-12-31T23:59", "1970-01-01", "0001-01-02"])
def test_status_at_a_moment_before_2000_is_one_error(at: str) -> None:
    """Before: accepted (the fleet before anything happened, an empty table that looks like an answer)."""
    line = one_error(invoke("ctl", "status", "--at", at, "--nats-url", NO_NATS), "--at", "before 2000")
    assert "cannot reach NATS" not in line


def test_status_at_a_moment_before_the_first_event_is_one_error(settings: Settings) -> None:
    """Before: an empty fleet "at 2001-01-01", as if that had been its state."""
    asyncio.run(publish_fresh(settings, small_fleet()))
    r = invoke("ctl", "status", "--nats-url", settings.nats_url, "--at", "2001-01-01")
    line = one_error(r, "--at 2001-01-01 00:00:00 UTC is before the first event stored", "give a time from then")
    assert datetime.now(UTC).strftime("%Y-%m-%d") in line  # when the history begins: the test published it now
    # From the first event on, --at answers.
    r = invoke("ctl", "status", "--nats-url", settings.nats_url, "--json", "--at", datetime.now(UTC).isoformat())
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["nodes"] == 5


# --- 2. a model name the Hugging Face Hub refuses ------------------------------------------------

HUB_REFUSES = {
    "1,000 characters": "a/" + "b" * 1000,
    "a part of 97 characters": "org/" + "x" * 97,
    "a double dash": "a--b/c",
    "a double dot": "a/b..c",
    "a trailing dot": "a/b.",
    "a trailing dash": "a/b-",
    "ending in .git": "a/b.git",
}


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("LLMGW_MODELS_DIR", raising=False)


@pytest.mark.usefixtures("offline")
@pytest.mark.parametrize("what", sorted(HUB_REFUSES))
def test_a_name_the_hub_refuses_is_a_model_error(what: str) -> None:
    """Before: huggingface_hub's HFValidationError, a traceback at the CLI; the planner replied with it, all of it."""
    name = HUB_REFUSES[what]
    for models_dir in (None, MODELS):
        with pytest.raises(ModelError, match="is not a name the Hugging Face Hub accepts") as e:
            modelinfo.load(name, models_dir_=models_dir)
        assert len(str(e.value)) < 600  # the name is shortened, not repeated in full


@pytest.mark.usefixtures("offline")
@pytest.mark.parametrize("what", sorted(HUB_REFUSES))
def test_ctl_model_plan_of_a_name_the_hub_refuses_is_one_error(what: str) -> None:
    name = HUB_REFUSES[what]
    one_error(invoke("ctl", "model", "plan", name, "--fleet", str(FLEET)), "is not a name the Hugging Face Hub accepts")
    one_error(invoke("ctl", "model", "plan", name, "--fleet", str(FLEET), "--models-dir", str(MODELS)),
              "is not a name the Hugging Face Hub accepts")


@pytest.mark.usefixtures("offline")
def test_ctl_model_plan_without_a_fleet_file_of_a_long_name_is_one_error() -> None:
    """Without --fleet and without a models directory the name goes to the planner (none here)."""
    one_error(invoke("ctl", "model", "plan", HUB_REFUSES["1,000 characters"], "--nats-url", NO_NATS),
              "cannot reach NATS")


@pytest.mark.usefixtures("offline")
@pytest.mark.parametrize("args", [
    (HUB_REFUSES["1,000 characters"], "--models-dir", str(MODELS)),
    (str(ROOT / "examples" / ("b" * 1000)),),
])
def test_ctl_model_plan_of_a_name_too_long_for_a_path_is_one_error(args: tuple[str, ...]) -> None:
    """Before: OSError: [Errno 36] File name too long, as a traceback (before asking any planner)."""
    r = invoke("ctl", "model", "plan", *args, "--nats-url", NO_NATS)
    if isinstance(r.exception, OSError):
        raise r.exception
    one_error(r)


def test_local_dir_finds_what_load_reads_and_refuses_what_cannot_be_a_path(tmp_path: Path) -> None:
    assert modelinfo.local_dir(str(MODELS / "google__gemma-2-9b-it"), None) == MODELS / "google__gemma-2-9b-it"
    assert modelinfo.local_dir("google/gemma-2-9b-it", MODELS) == MODELS / "google__gemma-2-9b-it"
    assert modelinfo.local_dir("google/gemma-2-9b-it", None) is None
    assert modelinfo.local_dir("a/" + "b" * 1000, MODELS) is None  # no such folder: the planner's to read
    with pytest.raises(ModelError, match="cannot be a model directory"):
        modelinfo.local_dir(str(tmp_path / ("b" * 1000)), None)


# --- 3. GPU classes and fabrics are bounded where they are decoded -------------------------------

INV = json.loads(m.encode(inventory("n1", "ib-a", 1, t(0))))
PLACED = json.loads(m.encode(placed("m-r1", spec("m"), [("n1", 0)], t(1))))
DECLARED = json.loads(m.encode(m.ModelDeclared(at=t(0), spec=spec("m"))))


def _with(doc: dict[str, Any], path: tuple[str | int, ...], value: Any) -> bytes:
    d = json.loads(json.dumps(doc))
    target = d
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return json.dumps(d).encode()


REFUSED: dict[str, bytes] = {
    "inventory: a GPU class with markup": _with(INV, ("gpus", 0, "gpu_class"), "<script>"),
    "inventory: a GPU class with markup before -80GB": _with(INV, ("gpus", 0, "gpu_class"), "<script>-80GB"),
    "inventory: a GPU class without its memory": _with(INV, ("gpus", 0, "gpu_class"), "H100"),
    "inventory: a GPU class of 300 characters": _with(INV, ("gpus", 0, "gpu_class"), "H" * 300 + "-80GB"),
    "inventory: a GPU class with a newline": _with(INV, ("gpus", 0, "gpu_class"), "H100-80GB\n"),
    "inventory: a fabric with markup": _with(INV, ("fabric",), "<script>"),
    "inventory: an empty fabric": _with(INV, ("fabric",), ""),
    "inventory: a fabric with a space": _with(INV, ("fabric",), "ib a"),
    "inventory: a fabric of 129 characters": _with(INV, ("fabric",), "f" * 129),
    "placement: a fabric with markup": _with(PLACED, ("fabric",), "<img src=x>"),
    "placement: a spec's GPU class with markup": _with(PLACED, ("spec", "gpu_class"), "<script>"),
    "declaration: a GPU class with markup": _with(DECLARED, ("spec", "gpu_class"), "<script>"),
    "declaration: an empty GPU class": _with(DECLARED, ("spec", "gpu_class"), ""),
}


@pytest.mark.parametrize("what", sorted(REFUSED))
def test_gpu_classes_and_fabrics_of_any_characters_are_refused_by_the_decoders(what: str) -> None:
    """Before: decoded, folded, and shown as they came in the status tables and the dashboard."""
    with pytest.raises(msgspec.ValidationError):
        m.decode_event(REFUSED[what])


def _ib_sysfs(root: Path, gid: str) -> Path:
    port = root / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    (port / "gids").mkdir(parents=True)
    (port / "gids" / "0").write_text(gid + "\n")
    (port / "link_layer").write_text("InfiniBand\n")
    return root


def test_every_fabric_detection_produces_is_decoded(tmp_path: Path) -> None:
    """NVLink fabric (cluster UUID, clique up to 2^32-1), InfiniBand subnet prefix, the node name, a fleet file's."""
    nvl = [GpuStatic(index=0, uuid="u", name="n", memory_mib=1, fabric_cluster_uuid="01020304-0506-0708-090a-0b0c0d0e0f10",
                     fabric_clique_id=2**32 - 1)]
    plain = [GpuStatic(index=0, uuid="u", name="n", memory_mib=1)]
    longest_node = "n" * m.NAME_MAX
    fabrics = [
        detect_fabric(longest_node, None, nvl, tmp_path / "none")[0],
        detect_fabric("gpu-01", None, plain, _ib_sysfs(tmp_path / "ib", "fe80:0000:0000:0000:0002:c903:0031:7b91"))[0],
        detect_fabric("gpu-01", None, plain, _ib_sysfs(tmp_path / "ib2", "ffff:ffff:ffff:ffff:0002:c903:0031:7b91"))[0],
        detect_fabric(longest_node, None, plain, tmp_path / "none")[0],
        *{n.fabric for n in fleetfile.load(FLEET).nodes},
    ]
    assert fabrics[:4] == ["nvl-01020304-0506-0708-090a-0b0c0d0e0f10-4294967295", "ib-fe80000000000000",
                           "ib-ffffffffffffffff", longest_node]
    for fabric in fabrics:
        assert m.decode_event(_with(INV, ("fabric",), fabric)).fabric == fabric  # type: ignore[union-attr]
        assert m.decode_event(_with(PLACED, ("fabric",), fabric)).fabric == fabric  # type: ignore[union-attr]
    assert m.decode_event(_with(PLACED, ("fabric",), "")).fabric == ""  # type: ignore[union-attr]


@pytest.mark.parametrize(("name", "mib", "expected"), [
    ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),  # as in test_nvml, and more
    ("NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"),
    ("NVIDIA H200", 143771, "H200-141GB"),
    ("NVIDIA GH200 480GB", 97871, "GH200-480GB"),
    ("NVIDIA B200", 183359, "B200-180GB"),
    ("NVIDIA GeForce RTX 4090", 24564, "RTX-24GB"),
    ("Tesla T4", 15360, "T4-16GB"),
    ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", 4864, "A100-40GB"),
])
def test_every_gpu_class_nvml_names_is_decoded(name: str, mib: int, expected: str) -> None:
    cls = gpu_class(name, mib)
    assert m.decode_event(_with(INV, ("gpus", 0, "gpu_class"), cls)).gpus[0].gpu_class == cls == expected  # type: ignore[union-attr]


def test_every_gpu_class_a_fleet_file_takes_is_decoded_and_the_rule_is_one() -> None:
    for node in fleetfile.load(FLEET).nodes:
        assert m.decode_event(m.encode(fleetfile.inventory(node, t(0)))).gpus[0].gpu_class == node.gpu_class  # type: ignore[union-attr]
    longest = "H" * 121 + "-999999GB"
    assert m.decode_event(_with(INV, ("gpus", 0, "gpu_class"), longest)).gpus[0].gpu_class == longest  # type: ignore[union-attr]
    assert m.decode_event(_with(DECLARED, ("spec", "gpu_class"), "H100-80GB")).spec.gpu_class == "H100-80GB"  # type: ignore[union-attr]


@pytest.mark.parametrize("fabric", ["rack1:ib", "dc/row-3", "ib@fe80", "a+b"])
def test_the_fabric_names_operators_wrote_before_the_bound_still_decode(fabric: str) -> None:
    # A node reported with `--fabric rack1:ib` before fabrics were bounded stays in the fleet on replay.
    assert m.fabric_problem(fabric) is None
    inv = m.NodeInventoryReported(at=m.utcnow(), node="n1", fabric=fabric, fabric_source="flag", boot_id="b", gpus=())
    assert m.decode_event(m.encode(inv)).fabric == fabric  # type: ignore[union-attr]


@pytest.mark.parametrize(("fabric", "shown"), [
    ("<script>", "(got '<script>')"),
    ("f" * 200, "(200 characters)"),
    ("ib a", "(got 'ib a')"),
])
def test_a_fleet_file_with_a_bad_fabric_is_one_line(tmp_path: Path, fabric: str, shown: str) -> None:
    f = tmp_path / "fleet.toml"
    f.write_text(f'[[nodes]]\nname = "n1"\nfabric = "{fabric}"\ngpu_class = "H100-80GB"\ngpu_count = 8\n'
                 'gpu_memory_mib = 81559\n')
    with pytest.raises(FleetFileError) as e:
        fleetfile.load(f)
    assert str(e.value).startswith(f"{f}: nodes[0].fabric must be 1 to {m.NAME_MAX} of letters, digits")
    assert shown in str(e.value) and "\n" not in str(e.value)


async def test_a_bad_class_or_fabric_is_unprojected_and_the_replay_goes_on(bus: Bus) -> None:
    await bus.publish(inventory("n1", "ib-a", 2, t(0)))
    bad = [REFUSED["inventory: a GPU class with markup"], REFUSED["inventory: a fabric with markup"]]
    for i, data in enumerate(bad):
        await bus.publish_bytes(subjects.fleet("n1", "inventory"), data, f"bad-{i}")
    await bus.publish(m.ModelDeclared(at=t(1), spec=spec("m")))
    await bus.publish_bytes(subjects.model("m2", "declared"), REFUSED["declaration: a GPU class with markup"], "bad-d")
    c = await replay(bus, use_snapshots=False)
    assert c.cursor.unprojected == 3
    assert c.state.nodes["n1"].fabric == "ib-a"
    assert {g.gpu_class for g in c.state.nodes["n1"].gpus.values()} == {"H100-80GB"}
    assert set(c.state.models) == {"m"}
