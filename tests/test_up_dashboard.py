"""``llmgw up``'s dashboard is closed like its bus: it asks for a key ``up`` makes once per data directory.

Security round 4, finding 3: the dashboard under ``up`` had no login, and anyone who reached its port
saw the fleet.
"""

from __future__ import annotations

import json
import re
import stat
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_e2e import FLEET, start_up, stop_up


def dashboard_line(up: subprocess.Popen[str]) -> str:
    assert up.stdout is not None
    while True:
        line = up.stdout.readline()
        assert line, "up ended before printing the dashboard's line"
        if line.startswith("dashboard: "):
            return line.rstrip("\n")


def status(url: str, key: str | None = None) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(url + "api/status", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:  # its answer's socket, closed
            return e.code, {}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ups_dashboard_asks_for_the_key_up_made_and_opens_only_when_told(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET)
    key_file = tmp_path / "data" / "dashboard.key"
    up, _ = start_up(tmp_path, fleet, "--no-example")
    try:
        line = dashboard_line(up)
        said = re.fullmatch(r"dashboard: (http://127\.0\.0\.1:\d+/)  \(log in with the key in (\S+)\)", line)
        assert said and Path(said.group(2)) == key_file.resolve(), line
        url = said.group(1)
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600  # the owner's, as the bus's logins are
        key = key_file.read_text().strip()
        assert status(url)[0] == 401  # nobody sees the fleet without it
        assert status(url, "not-the-key")[0] == 401
        code, body = status(url, key)
        assert code == 200 and body["scope"] == "admin"
    finally:
        stop_up(up)

    up, _ = start_up(tmp_path, fleet, "--no-example")  # the same data directory: the same key
    try:
        url = dashboard_line(up).split()[1]
        assert key_file.read_text().strip() == key
        assert status(url)[0] == 401 and status(url, key)[0] == 200
    finally:
        stop_up(up)

    up, _ = start_up(tmp_path, fleet, "--no-example", "--open-dashboard")
    try:
        line = dashboard_line(up)
        assert line.endswith("(OPEN: --open-dashboard, no login)"), line
        code, body = status(line.split()[1])
        assert code == 200 and body["scope"] == "open"
    finally:
        stop_up(up)
