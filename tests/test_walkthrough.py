"""The README's walkthrough, every command of its fenced blocks run as written, in order, in one reader's
shell: step 1's ``llmgw up`` in the background, the rest in a directory that has the repository's
``examples`` (issue 43: step 7 was refused for everyone, and step 2 could not log in to the bus).

What differs from a reader's machine, and only that: a shared machine cannot count on ports 4222, 8080
and 8081, so ``up`` takes free ones from the environment (``LLMGW_UP_PORT`` and the listen options'
variables, click's, which the command line does not see), the shell has ``LLMGW_NATS_URL`` (what the
default port would have been) and the curl lines name the router's port; HOME is empty, so no login
or model of this machine's is found. Where the prose says a reader waits (the replica healthy, a minute
idle), the test waits, bounded, for what the next command needs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from test_e2e import LLMGW, ROOT, stop_up, wait_for

README = (ROOT / "README.md").read_text()


def walkthrough_commands() -> list[str]:
    """The walkthrough's command lines, continuations joined, in order."""
    section = README.split("## Walkthrough", 1)[1].split("\n## ", 1)[0]
    out = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(line.strip())
    return out


def test_the_walkthrough_reads_its_commands_in_order() -> None:
    commands = walkthrough_commands()
    assert commands[0] == "llmgw up --simulate examples/fleet.toml --data-dir ./llmgw-data"
    assert any(c.startswith("llmgw ctl what-if --since 1h") for c in commands)
    assert sum(c.startswith("curl ") for c in commands) == 2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_walkthrough_command_runs_as_written(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    path = f"{Path(LLMGW).parent}:{os.environ['PATH']}"
    env = {"PATH": path, "HOME": str(home), "HF_HUB_OFFLINE": "1", "LANG": "C.UTF-8",
           "LLMGW_UP_PORT": "0", "LLMGW_UP_ROUTER_LISTEN": "127.0.0.1:0", "LLMGW_UP_DASHBOARD_LISTEN": "127.0.0.1:0"}
    commands = walkthrough_commands()
    up = subprocess.Popen(["bash", "-c", "exec " + commands[0]], cwd=tmp_path, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert up.stdout is not None
        printed = []
        while not printed or not printed[-1].startswith("look: "):
            printed.append(up.stdout.readline())
            assert printed[-1], f"up ended: {printed}"
        nats = re.match(r"nats: (nats://\S+)", printed[0])
        router = re.search(r"^router: (http://127\.0\.0\.1:\d+)/v1", "".join(printed), flags=re.M)
        assert nats and router, printed
        # What the reader's shell has from here on: the NATS the default port would have been (nothing of
        # up's data directory: the walkthrough's own export says where that is).
        shell = dict(env, LLMGW_NATS_URL=nats.group(1))
        exports: list[str] = []

        def sh(command: str, timeout: float = 60, check: bool = True) -> str:
            script = "set -eo pipefail\n" + "\n".join(exports) + "\n" + command.replace(
                "http://127.0.0.1:8080", router.group(1))  # type: ignore[union-attr]
            r = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=shell, capture_output=True, text=True,
                               timeout=timeout, check=False)
            assert r.returncode == 0 or not check, f"{command}\n→ {r.returncode}\n{r.stdout}\n{r.stderr}"
            return r.stdout if r.returncode == 0 else ""

        def status() -> dict[str, object]:  # for the test's waits: a projector still starting answers nothing
            return dict(json.loads(sh("llmgw ctl status --replicas --json", check=False) or '{"nodes": 0}'))

        def healthy(replica: str) -> bool:
            return any(r["replica_id"] == replica and r["state"] == "healthy"
                       for r in status().get("replica_list", ()))  # type: ignore[attr-defined]

        outputs: dict[str, str] = {}
        for command in commands[1:]:
            if command.startswith("export "):
                exports.append(command)
                sh(command)
                continue
            if "nodes" not in outputs:  # a reader glances at the dashboard: every node is there
                wait_for("the nine nodes reported", lambda: status()["nodes"] == 9, within_s=30)
                outputs["nodes"] = ""
            if command.startswith("curl ") and "stop" not in outputs:
                wait_for("coder-r1 healthy", lambda: healthy("coder-r1"), within_s=60)
            if command.startswith("llmgw replay --model coder") and "fault" in outputs:
                wait_for("coder-r2 healthy", lambda: healthy("coder-r2"), within_s=60)
                outputs.pop("fault")
            if command.startswith("llmgw ctl idle --older-than 1m") and "idle" not in outputs:
                wait_for("coder-r2 idle a minute", lambda: "coder-r2" in [r["replica_id"] for r in json.loads(sh(
                    "llmgw ctl idle --older-than 1m --json"))["idle"]], within_s=120, every_s=2)
                outputs["idle"] = ""
            out = sh(command)
            if command.startswith("llmgw replay --model coder --json"):
                assert '"node":"h100-a-03","index":0' in out, out  # where step 4 says coder-r1 is
            if command.startswith("llmgw agent fault"):
                outputs["fault"] = out
            if command.startswith("llmgw ctl idle --older-than 1m --stop") and "--dry-run" not in command:
                assert re.search(r"^stopped: .*coder-r2", out, flags=re.M), out  # (and up's idle example, qwen14)
                outputs["stop"] = out
            if command.startswith("curl ") and "stop" in outputs:
                assert json.loads(out)["system_fingerprint"] == "coder-r3", out  # woken
            if command.startswith("llmgw ctl what-if"):
                assert "never" in out, out
        assert "stop" in outputs
    finally:
        rest = stop_up(up)
    assert up.returncode == 0, rest
