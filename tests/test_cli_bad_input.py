"""Bad input at the CLI: one ``Error: …`` line, never a traceback.

A value click refuses while reading the command line (out of range, not a
name, not a duration) is a usage error: usage, then ``Error: …``, exit 2. A
mistake found after that (a file, a config, a fleet) is one ``Error: …``
line, exit 1. Nothing is published either way.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner, Result
from streams import stored

from llmgw import fleetfile, subjects
from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.errors import PlanError
from llmgw.fleet.state import fold
from llmgw.planner import candidates as planner
from llmgw.planner import modelinfo

ROOT = Path(__file__).resolve().parent.parent
FLEET = ROOT / "examples" / "fleet.toml"
MODELS = ROOT / "examples" / "models"
QWEN_DIR = MODELS / "Qwen__Qwen2.5-14B-Instruct"
LLMGW = str(Path(sys.executable).with_name("llmgw"))


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def usage_error(r: Result, *words: str) -> None:
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit))
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("Error: ") and all(w in last for w in words), r.output


def one_error(r: Result, *words: str) -> None:
    assert r.exit_code == 1, r.output
    assert isinstance(r.exception, SystemExit), repr(r.exception)
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and all(w in lines[0] for w in words), r.output


def plan(*args: str) -> Result:
    return invoke("ctl", "model", "plan", *args, "--fleet", str(FLEET), "--models-dir", str(MODELS))


# --- names and counts: refused before anything is published ------------------------------------


@pytest.mark.parametrize("name", ["", "new\nline", "trailing\n", "a b", "x" * 129])
async def test_a_model_name_outside_the_rule_is_a_usage_error_and_publishes_nothing(
        name: str, bus: Bus, nats_url: str) -> None:
    for args in (["deploy", name, "Qwen/Qwen2.5-14B-Instruct", "--from-plan", "--fleet", str(FLEET),
                  "--models-dir", str(MODELS)], ["scale", name, "--replicas", "1"], ["remove", name]):
        r = await asyncio.to_thread(invoke, "ctl", "model", *args, "--nats-url", nats_url)
        usage_error(r, "NAME must be 1 to 128 letters, digits")
    assert await stored(bus, subjects.STREAM_CONTROL) == []


@pytest.mark.parametrize("replicas", ["2147483648", "18446744073709551616", "10001"])
async def test_a_replica_count_past_the_bound_is_a_usage_error(replicas: str, bus: Bus, nats_url: str) -> None:
    """Before: accepted and published; the projector then failed every commit on it."""
    r = await asyncio.to_thread(invoke, "ctl", "model", "deploy", "qwen", "Qwen/Qwen2.5-14B-Instruct", "--from-plan",
                                "--candidate", "1", "--replicas", replicas, "--fleet", str(FLEET), "--models-dir",
                                str(MODELS), "--nats-url", nats_url)
    usage_error(r, "--replicas", "1<=x<=10000")
    r = await asyncio.to_thread(invoke, "ctl", "model", "scale", "qwen", "--replicas", replicas, "--nats-url", nats_url)
    usage_error(r, "--replicas", "0<=x<=10000")
    assert await stored(bus, subjects.STREAM_CONTROL) == []


# --- models and their configs ---------------------------------------------------------------------


def test_a_model_path_too_long_for_the_os_is_one_error() -> None:
    """Before: OSError [Errno 36] File name too long, as a traceback."""
    one_error(plan("a" * 1000), "cannot be a model directory", "File name too long", "1,000 characters")


def test_params_inf_is_a_usage_error() -> None:
    """Before: OverflowError: cannot convert float infinity to integer."""
    for value in ("infB", "nan", "1e400", "1e17"):
        usage_error(plan("Qwen/Qwen2.5-14B-Instruct", "--params", value), "--params")


def _model(tmp_path: Path, **change: object) -> Path:
    d = tmp_path / "Org__Model"
    shutil.copytree(QWEN_DIR, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_a_config_nested_100000_deep_is_one_error(tmp_path: Path) -> None:
    """Before: RecursionError from json.loads, as a traceback."""
    d = _model(tmp_path)
    (d / "config.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    one_error(plan(str(d)), "config.json is nested too deeply")


@pytest.mark.parametrize(("kv", "why"), [(0, "= 0 for 40"), (-8, "= -8 for 40"), (80, "= 80 for 40"), (3, "= 3 for 40"),
                                         ("8", "= '8' for 40")])
def test_kv_heads_that_cannot_group_the_attention_heads_are_refused(tmp_path: Path, kv: object, why: str) -> None:
    """Before: 0 was read as "no grouping" (as many KV heads as attention heads), 80 planned as given."""
    one_error(plan(str(_model(tmp_path, num_key_value_heads=kv))), "num_key_value_heads", why)


def test_a_config_field_of_the_wrong_kind_is_one_error(tmp_path: Path) -> None:
    one_error(plan(str(_model(tmp_path, num_experts_per_tok="many"))), "holds a value of the wrong kind")
    one_error(plan(str(_model(tmp_path.joinpath("b"), vocab_size=2**40))), "vocab_size")


def test_the_planner_refuses_kv_heads_that_do_not_group_a_models_heads() -> None:
    """Over the bus the ModelInfo comes as sent; the planner checks it as from_config does."""
    info = modelinfo.load(str(QWEN_DIR))
    state = fold(fleetfile.inventories(fleetfile.load(FLEET), m.utcnow()))
    for kv in (0, 80, 3):
        with pytest.raises(PlanError, match="KV heads|num_kv_heads"):
            planner.plan(msgspec.structs.replace(info, num_kv_heads=kv), state, m.PlanRequest(model=info.name))


# --- times and durations ---------------------------------------------------------------------------


@pytest.mark.parametrize("args", [
    ("ctl", "status", "--at", "9999999999h"),
    ("ctl", "status", "--replay", "--at", "9999999999h"),
    ("replay", "--since", "9999999999h"),
    ("replay", "--until", "9999999999h"),
    ("ctl", "status", "--at", "0001-01-01T00:00+01:00"),
    ("ctl", "status", "--idle-threshold", "9999999999h"),
])
def test_times_out_of_range_are_usage_errors(args: tuple[str, ...]) -> None:
    """Before: OverflowError: date value out of range, as a traceback."""
    usage_error(invoke(*args, "--nats-url", "nats://127.0.0.1:1"), "Invalid value for")


# --- files ------------------------------------------------------------------------------------------


def test_nats_with_a_data_dir_that_cannot_be_created_is_one_error() -> None:
    """Before: FileNotFoundError from mkdir, as a traceback."""
    one_error(invoke("nats", "--data-dir", "/proc/nope/nats", "--port", "0"), "cannot use /proc/nope/nats", "--data-dir")


def test_an_api_key_file_that_is_not_text_is_one_error(tmp_path: Path) -> None:
    """Before: UnicodeDecodeError, as a traceback."""
    keys = tmp_path / "keys"
    keys.write_bytes(b"\xff\xfe" + b"a" * 64 + b"\n")
    one_error(invoke("router", "--api-keys", str(keys), "--nats-url", "nats://127.0.0.1:1"), "is not text")


# --- fleet files: every command that reads one refuses what the agent would crash on -----------------

NODE = '[[nodes]]\nname = "n1"\nfabric = "ib-a"\ngpu_class = "H100-80GB"\ngpu_count = 8\ngpu_memory_mib = 81559\n'
BAD_FLEETS = {
    "unknown node": NODE + '[[faults]]\nnode = "n9"\ngpu = 0\nafter_s = 1\nkind = "ecc"\n',
    "unknown GPU": NODE + '[[faults]]\nnode = "n1"\ngpu = 8\nafter_s = 1\nkind = "ecc"\n',
    "bad xid": NODE + '[[faults]]\nnode = "n1"\ngpu = 0\nafter_s = 1\nkind = "xid=\u00b2"\n',
    "unknown table": NODE + "[scheduler]\ntick = 1\n",
    "node name with a newline": NODE.replace('"n1"', '"n1\\n"'),
}


@pytest.mark.parametrize("what", sorted(BAD_FLEETS))
def test_a_bad_fleet_file_is_refused_by_the_planner_too(tmp_path: Path, what: str) -> None:
    f = tmp_path / "fleet.toml"
    f.write_text(BAD_FLEETS[what])
    r = invoke("ctl", "model", "plan", "Qwen/Qwen2.5-14B-Instruct", "--fleet", str(f), "--models-dir", str(MODELS))
    one_error(r, str(f))


def test_a_fleet_file_past_the_size_cap_is_refused_unread(tmp_path: Path) -> None:
    """Before: a 50 MB file took 46 s and 3 GB to plan."""
    f = tmp_path / "fleet.toml"
    with f.open("w") as out:
        out.write(NODE)
        out.write(("# " + "x" * 1000 + "\n") * 50_000)
    one_error(plan_with(f), "is larger than 8 MiB")


def plan_with(fleet: Path) -> Result:
    return invoke("ctl", "model", "plan", "Qwen/Qwen2.5-14B-Instruct", "--fleet", str(fleet), "--models-dir", str(MODELS))


def test_up_with_a_bad_fleet_file_fails_at_once(tmp_path: Path) -> None:
    """Before: up started nats-server and its children, and the simulated agent crash-looped on the file."""
    f = tmp_path / "fleet.toml"
    f.write_text(BAD_FLEETS["unknown node"])
    proc = subprocess.Popen([LLMGW, "up", "--simulate", str(f), "--data-dir", str(tmp_path / "data"), "--port", "0",
                             "--no-example"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={k: v for k, v in os.environ.items() if k != "LLMGW_NATS_URL"})
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(f"llmgw up kept running on a bad fleet file:\n{out}") from None
    assert proc.returncode == 1, out
    assert out.strip().splitlines() == [f"Error: {f}: faults[0].node names no node of this file (got 'n9')"]
    assert not (tmp_path / "data").exists()  # nothing was started



@pytest.mark.parametrize(("args", "words"), [
    (("scheduler", "--heartbeat-timeout", "1e400"), ("--heartbeat-timeout", "0.5<=x<=86400")),
    (("agent", "liveness", "--timeout-s", "1e300"), ("--timeout-s",)),
    (("router", "--tick", "1e308"), ("--tick", "0.05<=x<=3600")),
    (("agent", "fault", "n1", "99999", "ecc"), ("GPU", "0<=x<=4095")),
    (("agent", "fault", "a b", "0", "ecc"), ("NODE", "letters, digits")),
    (("agent", "--node", "x\n", "--once"), ("--node", "letters, digits")),
    (("router", "--name", "r 1"), ("--name", "letters, digits")),
])
def test_values_that_would_go_into_every_event_of_a_service_are_bounded(args: tuple[str, ...], words: tuple[str, ...]) -> None:
    """Before: accepted, and then every NodeLost, idle map or command they made was refused by its readers."""
    usage_error(invoke(*args, "--nats-url", "nats://127.0.0.1:1"), *words)


def test_the_analysts_copy_under_its_old_and_new_name_at_once_is_a_usage_error() -> None:
    """``--snapshot-interval`` (before schema 5) is ``--analysts-copy-interval``: one of them, not both."""
    usage_error(invoke("project", "--once", "--snapshot-interval", "0", "--analysts-copy-interval", "5"),
                "--snapshot-interval is the old name of --analysts-copy-interval")
    usage_error(invoke("project", "--once", "--analysts-copy-interval", "-1"), "must be 0")
