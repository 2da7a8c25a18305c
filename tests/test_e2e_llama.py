"""The whole loop with a real engine: llama.cpp's llama-server, built from source on this
machine, serving a tiny GGUF that ``llmgw demo-model`` wrote, under ``llmgw up`` with real
engines on a one-node simulated fleet.

deploy → placed → healthy → chat, streamed chat and completions through the router,
answered by llama-server → the router's /metrics counts them with the engine's usage →
``ctl idle --stop`` → the next request wakes it → SIGKILL of the engine → restarted and
healthy. The planner's answer does not move after llama.cpp reports what it allocated,
and the engine's log is written while it runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from llama import llama_server_binary
from test_e2e import (
    LLMGW,
    ROOT,
    control_events,
    free_port,
    healthy,
    llmgw,
    ok,
    start_up,
    stop_up,
    wait_for,
)
from test_e2e_demand import woken_phases

FLEET = ROOT / "examples" / "cpu.toml"
CONTEXT, SLOTS = 512, 2


def plan_figures(url: str, model_dir: Path) -> list[tuple[Any, ...]]:
    """What the planner says of the demo model at a context larger than the one deployed."""
    reply = json.loads(ok(url, "ctl", "model", "plan", str(model_dir), "--context", "1024", "--all", "--json"))
    return [(c["gpu_class"], c["precision"], c["tp"], c["fits"], c["kv_tokens"], c["max_context"],
             c["observed_kv_tokens"], c["reason"]) for c in reply["candidates"]]


def replica_events(url: str, rid: str) -> list[dict[str, Any]]:
    return [e for e in control_events(url) if e["type"] == "ReplicaStateChanged" and e["replica_id"] == rid]


def engine_pid(port: int) -> int:
    """The llama-server process listening on ``port`` (its command line names it)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if Path(argv[0].decode(errors="replace")).name == "llama-server" and str(port).encode() in argv:
            return int(entry.name)
    raise AssertionError(f"no llama-server on port {port}")


def metric(text: str, name: str, model: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and f'model="{model}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_real_llama_server_serves_wakes_and_restarts_under_llmgw(tmp_path: Path) -> None:
    binary = llama_server_binary()
    model_dir = tmp_path / "tiny"
    made = subprocess.run([LLMGW, "demo-model", str(model_dir), "--context", "2048"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert made.returncode == 0, made.stdout + made.stderr
    router_port = free_port()
    up, url = start_up(tmp_path, FLEET, "--engines", "real", "--engine-cmd", f"llama.cpp={binary} -t 1",
                       "--router-tick", "0.3", router_port=router_port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="-", max_retries=0, timeout=60)
    try:
        wait_for("the simulated node reported", lambda: json.loads(ok(url, "ctl", "status", "--replay", "--json"))["nodes"] == 1)
        before = plan_figures(url, model_dir)
        assert before and all(c[6] is None for c in before)
        ok(url, "ctl", "model", "deploy", "tiny", str(model_dir), "--from-plan", "--precision", "q8_0",
           "--context", str(CONTEXT), "--parallel", str(SLOTS))
        first = wait_for("tiny-r1 healthy", lambda: healthy(url, "tiny-r1"), within_s=60)

        # Answered by llama-server itself: its `timings` come through the router untouched.
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello there"}],
                                               max_tokens=8)
        assert reply.choices[0].message.content is not None and reply.usage is not None
        assert reply.usage.prompt_tokens > 0 and "timings" in (reply.model_extra or {})
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=8, stream=True,
                                                     stream_options={"include_usage": True}))
        assert any("timings" in (c.model_extra or {}) for c in chunks)
        streamed = next(c.usage for c in reversed(chunks) if c.usage is not None)
        text = client.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=8,
                                         extra_headers={"X-Request-Id": "e2e-llama-1"})
        assert text.choices and text.usage is not None and "timings" in (text.model_extra or {})
        seen = (reply.usage.prompt_tokens + streamed.prompt_tokens + text.usage.prompt_tokens,
                reply.usage.completion_tokens + streamed.completion_tokens + text.usage.completion_tokens)

        # Issue 45, finding 3: straight to llama-server, around the router, is 401 (it has its own key, which
        # only routers read), and so is its /metrics; the key is in its environment, not its command line.
        for route, body in (("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}'),
                            ("/metrics", None)):
            direct = urllib.request.Request(first["endpoint"] + route, data=body,
                                            headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(direct, timeout=10) as r:
                    status = r.status
            except urllib.error.HTTPError as e:
                status = e.code
            assert status == 401, route
        pid = engine_pid(int(first["endpoint"].rsplit(":", 1)[1]))
        assert b"--api-key" not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert b"LLAMA_API_KEY=" in Path(f"/proc/{pid}/environ").read_bytes()

        # The router counted the three, with the tokens the engine said it used.
        with urllib.request.urlopen(f"http://127.0.0.1:{router_port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert metric(metrics, "llmgw_router_requests_total", "tiny") == 3
        assert metric(metrics, "llmgw_router_prompt_tokens_total", "tiny") == seen[0]
        assert metric(metrics, "llmgw_router_completion_tokens_total", "tiny") == seen[1]

        # A stream that does not ask for usage is counted all the same (the router asks llama-server for
        # it), and its client reads no usage chunk: every chunk has a choice, none carries usage.
        bare = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=8, stream=True))
        assert bare and all(c.choices and c.usage is None for c in bare)
        with urllib.request.urlopen(f"http://127.0.0.1:{router_port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert metric(metrics, "llmgw_router_prompt_tokens_total", "tiny") == seen[0] + streamed.prompt_tokens
        assert metric(metrics, "llmgw_router_completion_tokens_total", "tiny") >= seen[1]

        # Each can be traced: its id came back (the client's own, else a new one), and `ctl request` finds
        # its line in up's access log, with the replica and the tokens llama-server reported.
        assert reply._request_id and len(reply._request_id) == 32 and text._request_id == "e2e-llama-1"
        for rid, usage in ((reply._request_id, reply.usage), ("e2e-llama-1", text.usage)):
            found = wait_for(f"request {rid} in the access log", lambda rid=rid: (
                r := llmgw(url, "ctl", "request", rid, "--json")).returncode == 0 and json.loads(r.stdout))
            assert [(x["model"], x["replica"], x["status"], x["prompt_tokens"], x["completion_tokens"])
                    for x in found] == [("tiny", "tiny-r1", 200, usage.prompt_tokens, usage.completion_tokens)]
            assert found[0]["ttft_ms"] >= 0 and found[0]["file"].endswith("logs/router-access.log")

        # The engine's output is in its log while it runs, not when it exits.
        log = tmp_path / "data" / "logs" / "engines" / "tiny-r1.log"
        wait_for("llama-server's log written as it runs", lambda: log.is_file() and b"llama" in log.read_bytes())

        # What llama.cpp allocated is what it was asked: each slot the declared context, and the
        # planner's answer is the same after that report as before it.
        shown = json.loads(ok(url, "ctl", "model", "show", "tiny", "--json"))
        (row,) = shown["replicas"]
        assert row["kv_tokens_observed"] == row["kv_tokens_planned"] == CONTEXT * SLOTS
        assert f"{CONTEXT:,} context per slot / {CONTEXT:,} declared" in ok(url, "ctl", "model", "show", "tiny")
        assert [c[:3] + c[4:] for c in plan_figures(url, model_dir)] == [c[:3] + c[4:] for c in before]

        # Nobody asks: stopped; the next request wakes it and is answered.
        stopped = wait_for("tiny-r1 stopped for idleness", lambda: json.loads(
            ok(url, "ctl", "idle", "--older-than", "1s", "--stop", "--json"))["stopped"], within_s=30)
        assert stopped == ["tiny-r1"]
        woken = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "wake up"}],
                                               max_tokens=4)
        assert woken.choices and "timings" in (woken.model_extra or {})
        second = wait_for("tiny-r2 healthy", lambda: healthy(url, "tiny-r2"))
        assert second["endpoint"] != first["endpoint"]
        woken_phases(url, "tiny", "tiny-r2")  # the ledger, with a real engine's start-up in it

        # SIGKILL of the engine: the agent starts it again, and it serves.
        os.kill(engine_pid(int(second["endpoint"].rsplit(":", 1)[1])), signal.SIGKILL)
        wait_for("tiny-r2 restarted and healthy", lambda: [
            (e["state"], e["restarts"]) for e in replica_events(url, "tiny-r2")][-1:] == [("healthy", 1)], within_s=60)
        states = [e["state"] for e in replica_events(url, "tiny-r2")]
        assert states == ["starting", "healthy", "unhealthy", "starting", "healthy"], states
        assert "engine exited (-9)" in replica_events(url, "tiny-r2")[2]["detail"]
        again = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "again"}],
                                               max_tokens=4)
        assert again.choices
    finally:
        client.close()
        rest = stop_up(up)
    assert up.returncode == 0, rest
