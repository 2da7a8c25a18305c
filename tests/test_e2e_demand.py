"""The demand loop with every part a real process: parked models wake on an ``openai`` request,
two routers asking at once make one placement, load scales a model up, quiet scales it to zero.

``llmgw up --simulate`` runs NATS, the scheduler, a router and simulated agents whose
fake engines take a second to start; a second router process asks for the same models.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
from pathlib import Path
from typing import Any

import openai
import pytest
from test_e2e import (
    FLEET,
    LLMGW,
    MODEL,
    MODELS,
    cli_env,
    control_events,
    free_port,
    login,
    ok,
    start_up,
    stop_up,
    wait_for,
)


def model_state(url: str, name: str) -> str:
    return str(json.loads(ok(url, "ctl", "status", "--replay", "--json"))["model_states"].get(name, ""))


def replicas_of(url: str, name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(placed, stopped, autoscaled) control events of one model, oldest first."""
    events = control_events(url)
    placed = [e for e in events if e["type"] == "ReplicaPlaced" and e["model"] == name]
    stopped = [e for e in events if e["type"] == "ReplicaStopped" and e["model"] == name]
    scaled = [e for e in events if e["type"] == "ModelAutoscaled" and e["name"] == name]
    return placed, stopped, scaled


PHASES = ("wanted_at", "placed_at", "started_at", "healthy_at", "released_at", "first_byte_at")


def woken_phases(url: str, name: str, replica_id: str) -> dict[str, Any]:
    """The ledger's wake of ``replica_id`` once every phase is there (the router says with its next map)."""
    def done() -> dict[str, Any] | None:
        shown = json.loads(ok(url, "ctl", "model", "show", name, "--replay", "--json"))
        row = next((c for c in shown["cold_starts"] if c["replica_id"] == replica_id), None)
        return row if row is not None and all(row[p] for p in PHASES) else None

    row = wait_for(f"{replica_id}'s cold start in the ledger", done, within_s=30)
    assert row["cause"] == "wake" and row["requests"] >= 1
    times = [row[p] for p in PHASES]
    assert times == sorted(times), row  # wanted → placed → started → healthy → released → first byte
    return row


def chat(client: openai.OpenAI, model: str, stream: bool) -> str:
    if stream:
        chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    return reply.choices[0].message.content or ""


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_parked_models_wake_on_requests_and_autoscale_with_load(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET)
    port_a, port_b = free_port(), free_port()
    up, url = start_up(tmp_path, fleet, "--router-tick", "0.2", "--no-example", "--engine-startup-s", "1",
                       "--wake-timeout", "60", router_port=port_a)
    router = login(url, "router")  # the shared router login: it may speak for any router's name
    second = subprocess.Popen([LLMGW, "router", "--listen", f"127.0.0.1:{port_b}", "--name", "gw-2", "--tick", "0.2",
                               "--wake-timeout", "60", "--nats-url", url],
                              env={**cli_env(url), "LLMGW_NATS_USER": "router",
                                   "LLMGW_NATS_PASSWORD": router.password or ""},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    clients = [openai.OpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key="-", max_retries=0, timeout=60)
               for p in (port_a, port_b)]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=24)
    try:
        wait_for("agents reported", lambda: json.loads(ok(url, "ctl", "status", "--replay", "--json"))["nodes"] == 2)
        deploy = ("ctl", "model", "deploy")
        plan = ("--from-plan", "--fleet", str(fleet), "--precision", "bf16", "--tp", "1", "--context", "8192")
        ok(url, *deploy, "fixed", MODEL, *plan, "--idle-ttl", "2s")
        ok(url, *deploy, "auto", MODEL, *plan, "--min-replicas", "0", "--max-replicas", "2", "--target-in-flight", "4")

        # 1. Nobody asks: the fixed model is stopped for idleness, the autoscaled one scaled to zero.
        wait_for("fixed parked", lambda: model_state(url, "fixed") == "parked", within_s=40)
        wait_for("auto parked", lambda: model_state(url, "auto") == "parked", within_s=40)
        listed = {x.id: x.model_extra["state"] for x in clients[0].models.list().data}
        assert listed == {"fixed": "parked", "auto": "parked"}
        rows = {r["name"]: r for r in json.loads(ok(url, "ctl", "model", "list", "--json"))}
        assert {n: (r["state"], r["placed"], r["set_by"]) for n, r in rows.items()} == {
            "fixed": ("parked", 0, "declared"), "auto": ("parked", 0, "autoscaler")}
        table = ok(url, "ctl", "model", "list")
        assert "a request wakes it" in table and "auto 0–2, 4/replica" in table

        # 2. A plain request wakes the fixed model: held through placement and start-up, then answered.
        assert chat(clients[0], "fixed", stream=False)
        placed, stopped, _ = replicas_of(url, "fixed")
        assert [p["reason"] for p in placed] == ["0 of 1 running", "woken by router-up: 1 request waiting"]
        assert [s["reason"].split(":")[0] for s in stopped] == ["idle"]
        woken_phases(url, "fixed", placed[-1]["replica_id"])
        assert "Cold starts: 1 (1 wakes, 0 scale-ups)" in ok(url, "ctl", "model", "show", "fixed", "--replay")
        # The woken replica's engine said what it reserved: shown on the replica beside its plan, and never
        # kept as the model's (a simulated card does not size a cache).
        row = next(r for r in json.loads(ok(url, "ctl", "model", "list", "--json")) if r["name"] == "fixed")
        assert row["kv_tokens_planned"] > 0 and row["kv_tokens_observed"] == 0
        reported = [e["observed_kv_tokens"] for e in control_events(url) if e["type"] == "ReplicaStateChanged"
                    and e["replica_id"] == placed[-1]["replica_id"] and e["state"] == "healthy"]
        assert reported == [row["kv_tokens_planned"] * 97 // 100 // 16 * 16]

        # 3. Both routers at once, 16 requests (some streamed) for the model at zero: one wake,
        #    and the requests waiting push it up to its max; every request answered.
        asks = [pool.submit(chat, clients[i % 2], "auto", i % 4 == 0) for i in range(16)]
        answers = [f.result(timeout=90) for f in asks]
        assert all(answers)
        placed, stopped, scaled = replicas_of(url, "auto")
        wakes = [e for e in scaled if e["reason"].startswith("woken by")]
        assert len(wakes) == 1 and wakes[0]["replicas"] == 1
        assert len(placed) - 1 <= 2  # after the first replica: the wake and at most one scale-up (max 2)

        # 4. Quiet again: the autoscaler takes it back to zero, and a streamed request wakes it once more.
        wait_for("auto scaled to zero again", lambda: model_state(url, "auto") == "parked", within_s=40)
        assert chat(clients[1], "auto", stream=True)
        placed, stopped, scaled = replicas_of(url, "auto")
        downs = [e for e in scaled if e["replicas"] == 0]
        assert len(downs) == 2 and all(e["reason"].startswith("scaled down") for e in downs)
        assert [e["reason"].split(":")[0] for e in scaled if e["replicas"] > 0][-1] == "woken by gw-2"
        assert all(s["reason"].startswith("scaled down to") for s in stopped)
        timeline = ok(url, "replay", "--model", "auto")
        assert "woken by gw-2" in timeline

        # 5. The live history re-decided by the recorded policy is what happened; a TTL never stops less.
        first = min(json.loads(line)["stored_at"] for line in ok(url, "replay", "--json").splitlines() if line)
        report = json.loads(ok(url, "ctl", "what-if", "--since", first, "--idle-ttl", "fixed=never", "--json"))
        assert report["fidelity"]["reproduced"] >= 0.99, report["fidelity"]
        assert abs(report["fidelity"]["gpu_hours_diff"]) <= 0.02, report["fidelity"]
        fixed = report["asked"][0]["models"]["fixed"]
        assert fixed["gpu_hours"] > report["recorded"]["models"]["fixed"]["gpu_hours"]
        assert fixed["cold_starts"] == 0 < report["recorded"]["models"]["fixed"]["cold_starts"]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for c in clients:
            c.close()
        second.terminate()
        second.wait(10)
        rest = stop_up(up)
    assert up.returncode == 0, rest


def test_deploy_refuses_half_an_autoscale_and_min_above_max() -> None:
    env_args = ("--from-plan", "--fleet", str(MODELS.parent / "fleet.toml"))
    half = subprocess.run([LLMGW, "ctl", "model", "deploy", "x", MODEL, *env_args, "--min-replicas", "1"],
                          capture_output=True, text=True, timeout=30, check=False)
    assert half.returncode == 2 and "needs both --min-replicas and --max-replicas" in half.stderr
    upside = subprocess.run([LLMGW, "ctl", "model", "deploy", "x", MODEL, *env_args, "--min-replicas", "3",
                             "--max-replicas", "2"], capture_output=True, text=True, timeout=30, check=False)
    assert upside.returncode == 2 and "--min-replicas 3 is more than --max-replicas 2" in upside.stderr
