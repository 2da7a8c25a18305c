"""The whole loop as a user runs it: ``llmgw up --simulate`` → deploy from a plan → answers through
the router → an XID under the replica → re-placed, answers again → idle → stopped, cards free;
``ctl status`` and ``llmgw replay`` tell exactly that story.

Everything is a real process (nats-server, projector, planner, scheduler, router, simulated
agents, fake engines); every wait is bounded and every process is killed in ``finally``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from llmgw.config import Settings, credentials_path, read_credentials
from llmgw.router.journal import Journal, Mapped

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "examples" / "models"
LLMGW = str(Path(sys.executable).parent / "llmgw")
MODEL = "Qwen/Qwen2.5-14B-Instruct"

FLEET = """
[[nodes]]
name = "gpu-a"
fabric = "ib-a"
gpu_class = "A100-40GB"
gpu_count = 2
gpu_memory_mib = 40960

[[nodes]]
name = "gpu-b"
fabric = "ib-a"
gpu_class = "A100-40GB"
gpu_count = 2
gpu_memory_mib = 40960
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Each `up` a test started, by its NATS URL: its data directory, where the CLI finds its logins.
DATA_DIRS: dict[str, Path] = {}


def cli_env(nats_url: str) -> dict[str, str]:
    """The environment a user's shell has after `up`'s export line: the URL and the data directory."""
    env = dict(os.environ, LLMGW_NATS_URL=nats_url, LLMGW_MODELS_DIR=str(MODELS))
    if nats_url in DATA_DIRS:
        env["LLMGW_DATA_DIR"] = str(DATA_DIRS[nats_url])
    return env


def login(nats_url: str, user: str) -> Settings:
    """Settings that log in to an `up`'s NATS as one of its users (admin, cli, router, …)."""
    found = read_credentials(credentials_path(DATA_DIRS[nats_url]))
    assert found is not None and found[0] == nats_url
    return Settings(nats_url=nats_url, user=user, password=found[1][user], connect_timeout_s=2, request_timeout_s=5)


def llmgw(nats_url: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    env = cli_env(nats_url)
    return subprocess.run([LLMGW, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False)


def ok(nats_url: str, *args: str) -> str:
    r = llmgw(nats_url, *args)
    assert r.returncode == 0, f"llmgw {' '.join(args)} → {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def control_events(nats_url: str) -> list[dict[str, Any]]:
    out = ok(nats_url, "replay", "--stream", "control", "--json")
    return [json.loads(line)["event"] for line in out.splitlines() if line.strip()]


def wait_for(what: str, check: Any, within_s: float = 30.0, every_s: float = 0.3) -> Any:
    deadline = time.monotonic() + within_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {within_s:g}s (last: {last!r})")


def healthy(nats_url: str, replica: str) -> dict[str, Any] | None:
    for e in reversed(control_events(nats_url)):
        if e.get("replica_id") == replica and e["type"] == "ReplicaStateChanged":
            return e if e["state"] == "healthy" else None
    return None


def ask(client: openai.OpenAI, model: str) -> str:
    """One chat completion through the router; the fake engine names its replica in the fingerprint."""
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    assert reply.choices[0].message.content
    return reply.system_fingerprint or ""


def answered_by(client: openai.OpenAI, model: str, replica: str) -> bool:
    try:
        return ask(client, model) == replica
    except openai.APIError:
        return False


def start_up(tmp_path: Path, fleet: Path, *extra: str, router_port: int = 0) -> tuple[subprocess.Popen[str], str]:
    """``llmgw up --simulate`` in its own session; its NATS URL from the first line it prints."""
    # The tests' models are written under tmp_path: the agents' engines may read them from there, unless
    # the test names a narrower store itself (the confinement test keeps a secret beside its store).
    env = dict(os.environ, LLMGW_MODELS_DIR=str(MODELS))
    env.setdefault("LLMGW_ALLOW_MODEL_PATH", str(tmp_path))
    proc = subprocess.Popen(
        [LLMGW, "up", "--simulate", str(fleet), "--data-dir", str(tmp_path / "data"), "--port", "0",
         "--router-listen", f"127.0.0.1:{router_port or free_port()}", "--heartbeat-s", "1",
         "--dashboard-listen", "127.0.0.1:0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )
    assert proc.stdout is not None
    match = re.match(r"nats: (nats://\S+)", proc.stdout.readline())
    assert match
    DATA_DIRS[match.group(1)] = tmp_path / "data"
    return proc, match.group(1)


def stop_up(proc: subprocess.Popen[str]) -> str:
    """SIGTERM as Ctrl-C would; what it printed after the first line."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    out = proc.stdout.read() if proc.stdout else ""
    if proc.stdout:
        proc.stdout.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_up_deploy_fault_replace_idle_stop(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET)
    router_port = free_port()
    up, url = start_up(tmp_path, fleet, "--router-tick", "0.3", "--no-example", router_port=router_port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="unused", max_retries=0, timeout=5)

        # Plan over NATS (the planner service), then deploy the first candidate.
        def planned() -> dict[str, Any] | None:
            r = llmgw(url, "ctl", "model", "plan", MODEL, "--context", "8192", "--json")
            return json.loads(r.stdout) if r.returncode == 0 and json.loads(r.stdout)["candidates"] else None

        plan = wait_for("a plan with candidates (agents reported)", planned)
        first_candidate = plan["candidates"][0]
        assert first_candidate["gpu_class"] == "A100-40GB" and first_candidate["fits"]
        ok(url, "ctl", "model", "deploy", "qwen", MODEL, "--from-plan", "--candidate", "1", "--context", "8192")

        # The scheduler places it, the agent starts a fake engine, the router serves it.
        wait_for("qwen-r1 healthy", lambda: healthy(url, "qwen-r1"))
        wait_for("an answer from qwen-r1 through the router", lambda: answered_by(client, "qwen", "qwen-r1"))
        placed = next(e for e in control_events(url) if e["type"] == "ReplicaPlaced")
        gpu = placed["gpus"][0]

        # XID 79 on a GPU it holds: stopped, re-placed elsewhere, serving again.
        ok(url, "agent", "fault", gpu["node"], str(gpu["index"]), "xid=79")
        wait_for("qwen-r2 healthy", lambda: healthy(url, "qwen-r2"))
        wait_for("an answer from qwen-r2", lambda: answered_by(client, "qwen", "qwen-r2"), within_s=20)

        # Nobody asks any more: ctl idle --stop frees the cards once the router reports it idle.
        stopped = wait_for("qwen-r2 idle ≥ 1s and stopped", lambda: json.loads(
            ok(url, "ctl", "idle", "--older-than", "1s", "--stop", "--json"))["stopped"], within_s=20)
        assert stopped == ["qwen-r2"]

        def status() -> dict[str, Any] | None:
            data = json.loads(ok(url, "ctl", "status", "--json"))
            return data if data["replicas"] == 0 else None

        report = wait_for("status shows no replica", status)
        (a100,) = [c for c in report["capacity"] if c["gpu_class"] == "A100-40GB"]
        assert (a100["total"], a100["used"], a100["unhealthy"], a100["free"]) == (4, 0, 1, 3)

        # The story, in order, from the stored history: the decisions exactly, and each
        # replica's engine reports in order (agents and scheduler interleave freely).
        events = control_events(url)
        decisions = [(e["type"], e.get("replica_id") or e["spec"]["name"], e.get("reason", "").split(":")[0])
                     for e in events if e["type"] in ("ModelDeclared", "ReplicaPlaced", "ReplicaStopped")]
        assert decisions == [
            ("ModelDeclared", "qwen", ""),
            ("ReplicaPlaced", "qwen-r1", "0 of 1 running"),
            ("ReplicaStopped", "qwen-r1", "re-placing"),
            ("ReplicaPlaced", "qwen-r2", "0 of 1 running"),
            ("ReplicaStopped", "qwen-r2", "idle"),
        ]
        for rid in ("qwen-r1", "qwen-r2"):
            states = [e["state"] for e in events if e["type"] == "ReplicaStateChanged" and e["replica_id"] == rid]
            assert states == ["starting", "healthy", "stopped"], (rid, states)
        order = [(e["type"], e.get("replica_id"), e.get("state")) for e in events]
        assert order.index(("ReplicaStateChanged", "qwen-r1", "healthy")) < order.index(("ReplicaStopped", "qwen-r1", None))
        assert order.index(("ReplicaStateChanged", "qwen-r2", "healthy")) < order.index(("ReplicaStopped", "qwen-r2", None))
        endpoints = [e["endpoint"] for e in events if e["type"] == "ReplicaStateChanged" and e["state"] == "healthy"]
        stops = [e for e in control_events(url) if e["type"] == "ReplicaStopped"]
        assert f"GPU {gpu['index']} ({gpu['uuid']}) on {gpu['node']} unhealthy" in stops[0]["reason"]
        assert "79" in stops[0]["reason"]
        # The fleet stream has the XID that caused it.
        fleet_events = [json.loads(line)["event"] for line in ok(url, "replay", "--stream", "fleet", "--json").splitlines()]
        xid = [e for e in fleet_events if e["type"] == "GpuHealthChanged"]
        assert [(e["node"], e["gpu_index"], e["healthy"]) for e in xid] == [(gpu["node"], gpu["index"], False)]
        timeline = ok(url, "replay", "--model", "qwen")
        assert timeline.index("qwen-r1") < timeline.index("qwen-r2")
    finally:
        rest = stop_up(up)
    assert up.returncode == 0, rest
    assert rest.rstrip().endswith("stopped")
    # The router kept its quota journal in the data directory, cut at its last stored map.
    assert isinstance(Journal(tmp_path / "data" / "router-up.journal").read()[0], Mapped)
    # SIGTERM stopped everything: no engine outlives `up`.
    for endpoint in endpoints:
        host, port = endpoint.removeprefix("http://").rsplit(":", 1)
        with socket.socket() as s, pytest.raises(OSError):
            s.settimeout(2)
            s.connect((host, int(port)))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_second_up_continues_where_the_first_stopped(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET)
    proc, url = start_up(tmp_path, fleet)
    try:
        first = wait_for("the example replica healthy", lambda: healthy(url, "qwen14-r1"))
    finally:
        out = stop_up(proc)
    assert "declared qwen14: Qwen/Qwen2.5-14B-Instruct" in out and out.rstrip().endswith("stopped")

    proc, url = start_up(tmp_path, fleet)
    try:
        # The agents reconcile: the placement stored by the first run runs again, on a new port.
        again = wait_for("qwen14-r1 healthy again", lambda: (lambda h: h if h and h["endpoint"] != first["endpoint"] else None)(
            healthy(url, "qwen14-r1")))
        events = control_events(url)
    finally:
        out = stop_up(proc)
    assert "qwen14 was declared before; not declaring it again" in out
    assert [e["type"] for e in events].count("ModelDeclared") == 1
    assert [e["replica_id"] for e in events if e["type"] == "ReplicaPlaced"] == ["qwen14-r1"]
    assert again["node"] == first["node"]
