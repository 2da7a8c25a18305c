"""LoRA adapters end to end with a real llama-server: declared, attached by a roll, routed, removed.

``llmgw up --engines real`` on examples/cpu.toml; the demo model and a demo GGUF adapter
(``llmgw demo-model --lora``). Adding the adapter re-declares the llama.cpp base with it
attached, the scheduler rolls the replica, and the router sends a request naming the
adapter with the body's ``lora`` list: its temperature-0 answer differs from the base's and
equals llama-server's own answer for the same ``lora`` body, sent straight to the engine.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from test_e2e import LLMGW, ROOT, free_port, healthy, ok, start_up, stop_up, wait_for
from test_e2e_llama import engine_pid

from llmgw.agent.simnvml import engine_key

PROMPT = "hello the fleet"


def complete(url: str, body: dict[str, Any], key: str | None = None) -> str:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
        {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "seed": 1, **body}).encode(),
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


def status(url: str, *flags: str) -> dict[str, Any]:
    return json.loads(ok(url, "ctl", "status", *flags, "--json"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_adapter_is_attached_by_a_roll_routed_with_its_lora_body_and_removed(tmp_path: Path) -> None:
    from llama import llama_server_binary

    binary = llama_server_binary()
    model_dir = tmp_path / "tiny"
    made = subprocess.run([LLMGW, "demo-model", str(model_dir), "--lora", "sql", "--lora-rank", "16"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert made.returncode == 0, made.stdout + made.stderr
    adapter = model_dir / "loras" / "sql.gguf"
    router_port = free_port()
    up, url = start_up(tmp_path, ROOT / "examples" / "cpu.toml", "--engines", "real", "--engine-cmd",
                       f"llama.cpp={binary} -t 1", "--router-tick", "0.5", router_port=router_port)
    router = f"http://127.0.0.1:{router_port}"
    try:
        wait_for("the node reported", lambda: status(url, "--replay")["nodes"] == 1)
        ok(url, "ctl", "model", "deploy", "tiny", str(model_dir), "--from-plan", "--precision", "q8_0",
           "--context", "1024")
        wait_for("tiny-r1 healthy", lambda: healthy(url, "tiny-r1"), within_s=60)
        base = complete(router, {"model": "tiny"})

        added = json.loads(ok(url, "ctl", "adapter", "add", "sql", str(adapter), "--base", "tiny", "--json"))
        assert added["adapter"]["rank"] == 16 and added["adapter"]["format"] == "gguf"
        assert added["base_seq"] is not None  # llama.cpp attaches at start: the base re-declared, and rolled
        second = wait_for("tiny-r2 healthy with the adapter", lambda: healthy(url, "tiny-r2"), within_s=60)
        wait_for("tiny-r1 stopped", lambda: "tiny-r1" not in {
            r["replica_id"] for r in status(url, "--replay", "--replicas")["replica_list"]})
        listed = json.loads(ok(url, "ctl", "adapter", "list", "--json"))
        assert [(a["name"], a["base"], a["held_by"]) for a in listed] == [("sql", "tiny", ["tiny-r2"])]

        # Through the router, then straight at the engine with the same lora body: one answer.
        routed = wait_for("the router routes sql", lambda: _try(lambda: complete(router, {"model": "sql"})))
        # Straight at the engine takes its own key: read from its environment, as the node's own user may.
        key = engine_key(engine_pid(int(second["endpoint"].rsplit(":", 1)[1])))
        direct = complete(second["endpoint"], {"lora": [{"id": 0, "scale": 1.0}]}, key)
        assert routed == direct
        assert routed != complete(router, {"model": "tiny"}) == base  # the base's own answer, adapters at 0
        models = json.loads(urllib.request.urlopen(router + "/v1/models", timeout=10).read())["data"]
        assert {"id": "sql", "parent": "tiny"}.items() <= next(x for x in models if x["id"] == "sql").items()

        # The registry and who holds it rebuild from the streams as the live projection has them.
        # The router counts the routed request in its next tick's map: wait for the live projection to
        # say when sql was last asked for, so the replay below cannot read a tick the live answer missed.
        live = wait_for("the projector folded the tick that asked for sql", lambda: _try(
            lambda: (a := status(url)["adapters"]) and all(x["last_request"] for x in a) and a or None))
        assert live == status(url, "--replay")["adapters"]

        ok(url, "ctl", "adapter", "remove", "sql")
        wait_for("sql unlisted", lambda: all(x["id"] != "sql" for x in json.loads(
            urllib.request.urlopen(router + "/v1/models", timeout=10).read())["data"]))
        wait_for("tiny-r3 healthy without it", lambda: healthy(url, "tiny-r3"), within_s=60)
    finally:
        rest = stop_up(up)
    assert up.returncode == 0, rest


def _try(f: Any) -> Any:
    try:
        return f()
    except (OSError, AssertionError):
        return None
