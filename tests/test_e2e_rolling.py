"""Declarative deploys on real processes: the same deploy twice restarts nothing, a changed one rolls
while a client keeps asking, and not one of its requests fails.

``llmgw up --simulate`` with fake engines that take two seconds to start, as a real one takes
minutes: a roll that stopped an old replica before its successor served would drop requests.
"""

from __future__ import annotations

import threading
from pathlib import Path

import openai
import pytest
from test_e2e import FLEET, MODEL, control_events, free_port, ok, start_up, stop_up, wait_for


def healthy_replicas(url: str, name: str) -> set[str]:
    import json

    rows = json.loads(ok(url, "ctl", "status", "--replay", "--replicas", "--json"))["replica_list"]
    return {r["replica_id"] for r in rows if r["model"] == name and r["state"] == "healthy"}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_changed_deploy_rolls_without_a_failed_request_and_the_same_one_restarts_nothing(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET)
    port = free_port()
    up, url = start_up(tmp_path, fleet, "--router-tick", "0.5", "--no-example", "--engine-startup-s", "2",
                       router_port=port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=30)
    deploy = ("ctl", "model", "deploy", "roll", MODEL, "--from-plan", "--fleet", str(fleet), "--precision", "bf16",
              "--tp", "1", "--replicas", "2")
    stop = threading.Event()
    answered, failed = [], []

    def ask() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                reply = client.chat.completions.create(model="roll", messages=[{"role": "user", "content": f"q{i}"}])
                answered.append(reply.system_fingerprint)
            except openai.APIError as e:
                failed.append(repr(e))

    try:
        ok(url, *deploy, "--context", "8192")
        first = wait_for("two healthy replicas", lambda: (r := healthy_replicas(url, "roll")) and len(r) == 2 and r,
                         within_s=40)
        again = ok(url, *deploy, "--context", "8192")
        assert again.startswith("unchanged roll: declared as asked already; nothing published"), again
        assert sum(e["type"] == "ModelDeclared" for e in control_events(url)) == 1

        asker = threading.Thread(target=ask)
        asker.start()
        wait_for("requests flowing", lambda: len(answered) >= 20, within_s=20)
        changed = ok(url, *deploy, "--context", "4096")
        assert changed.startswith("changed roll: context 8,192 → 4,096"), changed
        assert "the scheduler rolls it" in changed
        # Two new replicas healthy, both old ones stopped.
        wait_for("the roll done", lambda: (r := healthy_replicas(url, "roll")) and len(r) == 2 and not r & first,
                 within_s=60)
        during = len(answered)
        wait_for("requests answered after the roll", lambda: len(answered) >= during + 20, within_s=20)
        stop.set()
        asker.join(30)
        assert failed == [], failed[:5]
        events = control_events(url)
        stops = [e for e in events if e["type"] == "ReplicaStopped" and e["model"] == "roll"]
        assert {e["replica_id"] for e in stops} == first
        assert all(e["reason"].startswith("spec changed") and e["code"] == "spec_changed" for e in stops)
        # The old replicas answered before the change, the new ones after: the clients saw both, never an error.
        assert set(answered[:10]) <= first and set(answered[-10:]).isdisjoint(first)
    finally:
        stop.set()
        client.close()
        rest = stop_up(up)
    assert up.returncode == 0, rest


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_idle_time_survives_an_up_restart(tmp_path: Path) -> None:
    """A replica nobody asked for since before a restart is as idle after it (to a router tick), not "5s"."""
    import json
    import time

    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET)
    port = free_port()
    args = ("--router-tick", "0.5", "--no-example")

    def idle_of(url: str, rid: str) -> float | None:
        rows = json.loads(ok(url, "ctl", "status", "--replay", "--replicas", "--json"))["replica_list"]
        row = next((r for r in rows if r["replica_id"] == rid), None)
        return None if row is None or row["idle_s"] < 0 else float(row["idle_s"])

    up, url = start_up(tmp_path, fleet, *args, router_port=port)
    try:
        ok(url, "ctl", "model", "deploy", "quiet", MODEL, "--from-plan", "--fleet", str(fleet), "--precision", "bf16",
           "--tp", "1", "--context", "8192")
        (rid,) = wait_for("a healthy replica", lambda: healthy_replicas(url, "quiet"), within_s=40)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=30)
        client.chat.completions.create(model="quiet", messages=[{"role": "user", "content": "once"}])
        client.close()
        wait_for("the request in a map", lambda: (x := idle_of(url, rid)) is not None and x < 5, within_s=10)
        time.sleep(4)  # nobody asks
        before = idle_of(url, rid)
        assert before is not None and before >= 3
    finally:
        stop_up(up)
    up, url = start_up(tmp_path, fleet, *args, router_port=port)  # the same data directory: the same streams
    try:
        restarted = time.monotonic()
        # The restarted router's first map says what its last one said: idle since the same request.
        after = wait_for("the restarted router's map", lambda: idle_of(url, rid), within_s=30)
        elapsed = time.monotonic() - restarted
        assert before <= after <= before + elapsed + 15, (before, after)  # not "idle 5s", nor made up
    finally:
        rest = stop_up(up)
    assert up.returncode == 0, rest
