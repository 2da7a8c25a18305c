"""``llmgw up`` is closed by default: every part logs in as its role, and a process without a login
is refused. Before: any local process could publish as any part, and a stray ``llmgw agent`` joined
the fleet as a node nobody could remove (``ctl node retire`` now does)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest
from test_e2e import LLMGW, cli_env, llmgw, ok, start_up, stop_up, wait_for

from llmgw.bus import Bus
from llmgw.config import Settings, credentials_path
from llmgw.errors import ConnectError

NODE = """
[[nodes]]
name = "{name}"
fabric = "local"
gpu_class = "L4-24GB"
gpu_count = 1
gpu_memory_mib = 23034
"""


async def connect(url: str) -> None:
    """Connect without a login, and leave."""
    bus = await Bus.connect(Settings(nats_url=url, connect_timeout_s=2), "nobody", reconnect=False)
    await bus.close()


def nodes(url: str) -> int:
    return int(json.loads(ok(url, "ctl", "status", "--replay", "--json"))["nodes"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_up_is_closed_and_a_stray_agent_cannot_join(tmp_path: Path) -> None:
    fleet, stray = tmp_path / "fleet.toml", tmp_path / "stray.toml"
    fleet.write_text(NODE.format(name="cpu-01"))
    stray.write_text(NODE.format(name="stray-01"))
    up, url = start_up(tmp_path, fleet, "--no-example")
    try:
        creds = credentials_path(tmp_path / "data")
        assert creds.stat().st_mode & 0o777 == 0o600
        # No login: refused, and told where the logins are.
        with pytest.raises(ConnectError, match="wants a login.*LLMGW_DATA_DIR"):
            asyncio.run(connect(url))
        # The CLI finds the data directory's logins (as after up's export line), and sees the one node.
        wait_for("the node reported", lambda: nodes(url) == 1)
        # A stray agent, with no login or with the CLI's, cannot speak for a node.
        bare = {k: v for k, v in cli_env(url).items() if k != "LLMGW_DATA_DIR"}
        for env in (bare, cli_env(url)):
            r = subprocess.run([LLMGW, "agent", "--simulate", str(stray), "--once", "--nats-url", url], env=env,
                               capture_output=True, text=True, timeout=60, check=False)
            last = r.stderr.strip().splitlines()[-1]
            assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
            assert last.startswith("Error: ") and ("wants a login" in last or "refused" in last), r.stderr
        assert nodes(url) == 1
        # Retiring is admin's: the CLI's own login is refused; the operator's (admin, found the same way) is not.
        cli_login = json.loads(creds.read_text())["users"]["cli"]
        refused = llmgw(url, "ctl", "node", "retire", "cpu-01", "--force", "--nats-user", "cli",
                        "--nats-password", cli_login)
        assert refused.returncode == 1 and "refused" in refused.stderr, refused.stderr
        live = llmgw(url, "ctl", "node", "retire", "cpu-01")
        assert live.returncode == 1 and "is not lost" in live.stderr, live.stderr
        assert "retired cpu-01" in ok(url, "ctl", "node", "retire", "cpu-01", "--force", "--reason", "test")
        assert nodes(url) == 0
        assert "node cpu-01 retired by an operator: test" in ok(url, "replay", "--stream", "fleet")
    finally:
        rest = stop_up(up)
    assert up.returncode == 0, rest


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_up_insecure_is_the_open_bus_of_before(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(NODE.format(name="cpu-01"))
    up, url = start_up(tmp_path, fleet, "--no-example", "--insecure")
    try:
        asyncio.run(connect(url))  # anyone
        assert not credentials_path(tmp_path / "data").exists()
    finally:
        rest = stop_up(up)
    assert up.returncode == 0, rest
