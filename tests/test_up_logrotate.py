"""logrotate against ``llmgw up``: SIGUSR1 to ``up`` reopens the router's access log, and one sent while
the router is still starting is no way to end it (SIGUSR1's default action ends a process)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_e2e import FLEET, start_up, stop_up, wait_for


def ask(router: str) -> None:
    """A request on an OpenAI route (each gets a line): for a model nobody declared, so a 404."""
    body = json.dumps({"model": "nobody", "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(router + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
    except urllib.error.HTTPError as e:
        with e:
            pass


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigusr1_during_the_start_ends_nothing_and_after_it_reopens_the_access_log(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET)
    log = tmp_path / "data" / "logs" / "router-access.log"
    up, _ = start_up(tmp_path, fleet, "--no-example")
    printed: list[str] = []
    try:
        assert up.stdout is not None
        # As logrotate would on a schedule that falls in the start, every 10 ms until the router serves.
        started = threading.Event()

        def rotate_meanwhile() -> None:
            while not started.wait(0.01):
                os.kill(up.pid, signal.SIGUSR1)

        rotating = threading.Thread(target=rotate_meanwhile)
        rotating.start()
        try:
            while not printed or not printed[-1].startswith("router: "):
                printed.append(up.stdout.readline())
                assert printed[-1], f"up ended: {printed}"
        finally:
            started.set()
            rotating.join()
        router = re.match(r"router: (http://\S+)/v1", printed[-1])
        assert router, printed[-1]
        ask(router.group(1))
        wait_for("the first request's line", lambda: log.exists() and '"route":"/v1/chat/completions"' in log.read_text(), 10)
        log.rename(log.with_name("router-access.log.1"))  # logrotate's move, then its postrotate
        os.kill(up.pid, signal.SIGUSR1)
        time.sleep(0.5)
        ask(router.group(1))
        wait_for("a line in the new file", lambda: log.exists() and log.read_text().strip(), 10)
        assert json.loads(log.read_text().splitlines()[0])["route"] == "/v1/chat/completions"
    finally:
        out = stop_up(up)
    assert "router exited" not in "".join(printed) + out, "".join(printed) + out
