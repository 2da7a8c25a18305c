"""More models than cards, end to end: 20 small models on 4 simulated 16 GiB cards, all healthy at once.

``llmgw up`` with fake engines: every model is planned by the planner (demo models of
several sizes, at several slot counts), placed by the scheduler on cards it shares,
started by the agents and answered through the router; a two-card model declared after
them still finds two whole cards, because packing kept the holes.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import openai
import pytest
from test_e2e import LLMGW, free_port, ok, start_up, stop_up, wait_for

FLEET = """
[[nodes]]
name = "n0"
fabric = "local"
gpu_class = "CPU-16GB"
gpu_count = 2
gpu_memory_mib = 16384

[[nodes]]
name = "n1"
fabric = "local"
gpu_class = "CPU-16GB"
gpu_count = 2
gpu_memory_mib = 16384
"""


def demo(path: Path, *args: str) -> Path:
    made = subprocess.run([LLMGW, "demo-model", str(path), *args], capture_output=True, text=True, timeout=120,
                          check=False)
    assert made.returncode == 0, made.stdout + made.stderr
    return path


def status(url: str) -> dict:  # type: ignore[type-arg]
    return json.loads(ok(url, "ctl", "status", "--replay", "--replicas", "--json"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_twenty_models_share_four_cards_and_a_two_card_model_still_fits(tmp_path: Path) -> None:
    tiny = demo(tmp_path / "tiny")
    mid = demo(tmp_path / "mid", "--layers", "8", "--embd", "512", "--heads", "8", "--kv-heads", "8",
               "--context", "32768")
    # Several sizes: the tiny model, and the 35 MB one with 1, 2 or 4 slots of 32k context (KV 0.5-2 GiB).
    entries = [(f"t{i}", tiny, 2048, 1) for i in range(8)]
    entries += [(f"m{slots}x{i}", mid, 32768, slots) for slots in (1, 2, 4) for i in range(4)]
    assert len(entries) == 20
    declarations = tmp_path / "models.toml"
    declarations.write_text("".join(
        f'[[model]]\nname = "{name}"\nmodel = "{path}"\nprecision = "q8_0"\ncontext = {context}\nparallel = {slots}\n\n'
        for name, path, context, slots in entries))
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET)
    router_port = free_port()
    up, url = start_up(tmp_path, fleet, "--router-tick", "0.5", "--no-example", router_port=router_port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="-", max_retries=0, timeout=30)
    try:
        wait_for("both nodes reported", lambda: status(url)["nodes"] == 2)
        ok(url, "apply", str(declarations))

        def all_healthy() -> dict | None:  # type: ignore[type-arg]
            s = status(url)
            rows = s["replica_list"]
            return s if len(rows) == 20 and all(r["state"] == "healthy" for r in rows) else None

        s = wait_for("20 replicas healthy at once", all_healthy, within_s=180, every_s=1.0)
        bookings = s["gpu_bookings"]
        # Packed onto two cards, never past a card's memory, and what each GPU holds adds up.
        assert all(b["booked_mib"] <= b["memory_mib"] for b in bookings), bookings
        assert all(b["booked_mib"] == sum(mib for _, mib in b["replicas"]) for b in bookings)
        held = Counter((b["node"], b["index"]) for b in bookings)
        assert len(held) == 2, bookings
        assert sum(len(b["replicas"]) for b in bookings) == 20
        for name, *_ in entries:  # each is answered, by its own replica, through the router
            reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2)
            assert reply.system_fingerprint == f"{name}-r1"

        # 2 x 12.5 GiB: no partly booked card has room for a rank; two whole cards on one node do.
        ok(url, "ctl", "model", "deploy", "big", str(mid), "--from-plan", "--precision", "q8_0", "--tp", "2",
           "--context", "32768", "--parallel", "48")
        big = wait_for("big placed", lambda: next((r for r in status(url)["replica_list"] if r["model"] == "big"), None))
        assert len({g["node"] for g in big["gpus"]}) == 1 and len(big["gpus"]) == 2
        assert not {(g["node"], g["index"]) for g in big["gpus"]} & set(held)
        assert all(b["booked_mib"] <= b["memory_mib"] for b in status(url)["gpu_bookings"])
    finally:
        client.close()
        rest = stop_up(up)
    assert up.returncode == 0, rest


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_llama_servers_share_one_card_and_none_is_booked_past_it(tmp_path: Path) -> None:
    from llama import llama_server_binary

    binary = llama_server_binary()
    tiny = demo(tmp_path / "tiny")
    mid = demo(tmp_path / "mid", "--layers", "8", "--embd", "512", "--heads", "8", "--kv-heads", "8",
               "--context", "8192")
    router_port = free_port()
    cpu = Path(__file__).resolve().parents[1] / "examples" / "cpu.toml"  # one simulated 16 GiB card
    up, url = start_up(tmp_path, cpu, "--engines", "real", "--engine-cmd", f"llama.cpp={binary} -t 1",
                       "--router-tick", "0.5", router_port=router_port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="-", max_retries=0, timeout=60)
    try:
        wait_for("the node reported", lambda: status(url)["nodes"] == 1)
        for name, path, context in (("tiny", tiny, "2048"), ("mid", mid, "8192"), ("mid2", mid, "4096")):
            ok(url, "ctl", "model", "deploy", name, str(path), "--from-plan", "--precision", "q8_0",
               "--context", context)

        def all_healthy() -> dict | None:  # type: ignore[type-arg]
            s = status(url)
            rows = s["replica_list"]
            return s if len(rows) == 3 and all(r["state"] == "healthy" for r in rows) else None

        s = wait_for("three llama-servers healthy on one card", all_healthy, within_s=120, every_s=1.0)
        (card,) = s["gpu_bookings"]
        assert len(card["replicas"]) == 3 and card["booked_mib"] <= card["memory_mib"], card
        for name in ("tiny", "mid", "mid2"):  # llama-server itself answers each, through the router
            reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2)
            assert reply.choices and "timings" in (reply.model_extra or {})
    finally:
        client.close()
        rest = stop_up(up)
    assert up.returncode == 0, rest
