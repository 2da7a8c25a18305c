"""A replica over two nodes, with every part a real process: both parts start, the head answers
through the router, an XID on the worker's GPU stops the whole replica (no part left running), and
it is re-placed on two nodes of the other fabric and answers again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import openai
import pytest
from test_e2e import MODEL, answered_by, control_events, free_port, ok, start_up, stop_up, wait_for

FLEET = "".join(f"""
[[nodes]]
name = "{name}"
fabric = "{fabric}"
gpu_class = "L4-24GB"
gpu_count = 1
gpu_memory_mib = 23034
""" for name, fabric in (("a1", "ib-a"), ("a2", "ib-a"), ("b1", "ib-b"), ("b2", "ib-b")))


def part_processes(replica: str) -> list[str]:
    """Command lines of running fake-engine processes (heads and worker parts) of one replica."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = (Path("/proc") / pid / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = [a.decode(errors="replace") for a in argv]
        if "fake-engine" in text and any(a == replica or a.startswith(f"{replica}/part") for a in text):
            out.append(" ".join(text))
    return out


def replica(url: str, rid: str) -> dict[str, Any] | None:
    return next((e for e in control_events(url) if e["type"] == "ReplicaPlaced" and e["replica_id"] == rid), None)


def healthy_parts(url: str, rid: str) -> set[str]:
    states: dict[str, str] = {}
    for e in control_events(url):
        if e["type"] == "ReplicaStateChanged" and e["replica_id"] == rid:
            states[e["node"]] = e["state"]
    return {n for n, s in states.items() if s == "healthy"}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_replica_over_two_nodes_runs_everywhere_and_moves_whole(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET)
    port = free_port()
    up, url = start_up(tmp_path, fleet, "--router-tick", "0.3", "--no-example", "--engine-startup-s", "0",
                       router_port=port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=10)
    try:
        wait_for("agents reported", lambda: json.loads(ok(url, "ctl", "status", "--replay", "--json"))["nodes"] == 4)
        ok(url, "ctl", "model", "deploy", "qwen-split", MODEL, "--from-plan", "--fleet", str(fleet), "--precision", "bf16",
           "--tp", "1", "--pp", "2", "--context", "8192")
        first = wait_for("qwen-split-r1 placed", lambda: replica(url, "qwen-split-r1"))
        assert len(first["nodes"]) == 2
        head, worker = first["nodes"]
        wait_for("both parts of qwen-split-r1 healthy", lambda: healthy_parts(url, "qwen-split-r1") == {head, worker})
        wait_for("an answer from qwen-split-r1's head", lambda: answered_by(client, "qwen-split", "qwen-split-r1"))
        procs = part_processes("qwen-split-r1")
        assert len(procs) == 2 and sum("--join" in p for p in procs) == 1  # a head, and one part that joined it

        # XID 79 under the worker part: the whole replica stops, and nothing of it keeps running.
        gpu = next(g for g in first["gpus"] if g["node"] == worker)
        ok(url, "agent", "fault", worker, str(gpu["index"]), "xid=79")
        second = wait_for("qwen-split-r2 placed", lambda: replica(url, "qwen-split-r2"), within_s=30)
        wait_for("no process of qwen-split-r1 left", lambda: part_processes("qwen-split-r1") == [], within_s=30)
        fabric_of = {"a1": "ib-a", "a2": "ib-a", "b1": "ib-b", "b2": "ib-b"}
        assert len({fabric_of[n] for n in second["nodes"]}) == 1 and worker not in second["nodes"]
        wait_for("both parts of qwen-split-r2 healthy", lambda: healthy_parts(url, "qwen-split-r2") == set(second["nodes"]),
                 within_s=40)
        wait_for("an answer from qwen-split-r2", lambda: answered_by(client, "qwen-split", "qwen-split-r2"), within_s=30)
        stops = [e for e in control_events(url) if e["type"] == "ReplicaStopped"]
        assert [s["replica_id"] for s in stops] == ["qwen-split-r1"]
        assert f"on {worker} unhealthy" in stops[0]["reason"]
        story = ok(url, "replay", "--model", "qwen-split")
        for node in (*first["nodes"], *second["nodes"]):
            assert f"on {node} is healthy" in story  # replay tells it per node
    finally:
        client.close()
        rest = stop_up(up)
    assert up.returncode == 0, rest
    assert part_processes("qwen-split-r2") == []
