"""What the ``nats`` CLI shows of llmgw: consumers that say whose they are, and its environment variables."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest
from click.testing import CliRunner

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.config import DEFAULT_NATS_URL, Settings


async def consumers(bus: Bus, stream: str) -> dict[str, dict[str, Any]]:
    """What `nats consumer ls` lists: every consumer of ``stream`` by name, with its config."""
    msg = await bus.nc.request(subjects.js_api("CONSUMER.LIST", stream), b"{}", timeout=5)
    return {c["name"]: c["config"] for c in json.loads(msg.data)["consumers"]}


async def test_every_consumer_names_its_process_and_purpose(settings: Settings, bus: Bus) -> None:
    await bus.publish(m.ModelRemoved(at=m.utcnow(), name="x"))
    named = await Bus.connect(settings, "llmgw-router-gw.1", reconnect=False)  # a dot is not allowed in a name
    try:
        follower = named.follow(subjects.STREAM_CONTROL, m.CONTROL_DECODER, who="router endpoints")
        other = named.reader(subjects.STREAM_CONTROL, 1, filter_subjects=[subjects.model("x", "removed")])
        tasks = [asyncio.create_task(anext(aiter(x.batches()))) for x in (follower, other)]  # type: ignore[arg-type]
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        seen = await consumers(bus, subjects.STREAM_CONTROL)
        ours = {n: c for n, c in seen.items() if n.startswith("llmgw-router-gw_1-LLMGW_CONTROL-")}
        assert len(ours) == 2, sorted(seen)  # two readers of one process: two names, no collision
        descriptions = sorted(c["description"] for c in ours.values())
        assert descriptions[0].startswith("llmgw-router-gw.1 (router endpoints) follows LLMGW_CONTROL from seq 1; host ")
        assert descriptions[1].startswith("llmgw-router-gw.1 follows LLMGW_CONTROL from seq 1, only llmgw.control.model.x")
        assert all(f"pid {os.getpid()}" in d for d in descriptions)
        for t in tasks:
            t.cancel()
    finally:
        await named.close()


def test_nats_cli_variables_are_fallbacks(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    creds = tmp_path / "user.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n")
    for name in ("LLMGW_NATS_URL", "LLMGW_NATS_CREDS", "NATS_URL", "NATS_CREDS"):
        monkeypatch.delenv(name, raising=False)
    assert Settings.from_env().nats_url == DEFAULT_NATS_URL
    monkeypatch.setenv("NATS_URL", "nats://from-nats-cli:4222")
    monkeypatch.setenv("NATS_CREDS", str(creds))
    got = Settings.from_env()
    assert (got.nats_url, got.creds_file) == ("nats://from-nats-cli:4222", str(creds))
    monkeypatch.setenv("LLMGW_NATS_URL", "nats://ours:4222")
    assert Settings.from_env().nats_url == "nats://ours:4222"  # ours first
    assert Settings.from_env(nats_url="nats://flag:4222").nats_url == "nats://flag:4222"  # a flag before both


def test_the_cli_finds_nats_through_nats_url() -> None:
    env = {"LLMGW_NATS_URL": None, "NATS_URL": "nats://127.0.0.1:1", "NATS_CREDS": None, "LLMGW_NATS_CREDS": None}
    res = CliRunner().invoke(cli, ["ctl", "status"], env=env)
    assert res.exit_code == 1
    assert "cannot reach NATS at nats://127.0.0.1:1" in res.output
