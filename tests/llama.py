"""A real llama.cpp llama-server for tests: built once per machine by scripts/llama-server.sh."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "llama-server.sh"
# The first build on a machine takes ~20 CPU-minutes, and a caller may wait on another's build.
BUILD_LIMIT_S = 45 * 60
READY_LIMIT_S = 60.0


def installed(script: Path, env: str, limit_s: float, what: str) -> Path:
    """The program ``script`` prints on its last line (installing or building it once per machine), or
    the one ``env`` names; a failed install fails, never skips. scripts/test.sh runs each script before
    the suite and exports ``env``."""
    given = os.environ.get(env)
    if given and os.access(given, os.X_OK):
        return Path(given)
    try:
        res = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired as e:
        said = b"".join(x if isinstance(x, bytes) else (x or "").encode() for x in (e.stdout, e.stderr))
        pytest.fail(f"{script} did not finish within {limit_s:g}s:\n{said.decode(errors='replace')}",
                    pytrace=False)
    lines = res.stdout.strip().splitlines()
    binary = Path(lines[-1]) if lines else None
    if res.returncode or binary is None or not os.access(binary, os.X_OK):
        pytest.fail(f"{script} exited {res.returncode} without {what}:\n{res.stdout}{res.stderr}", pytrace=False)
    return binary


@functools.cache
def llama_server_binary() -> Path:
    """The llama-server scripts/llama-server.sh builds (LLMGW_LLAMA_SERVER)."""
    return installed(SCRIPT, "LLMGW_LLAMA_SERVER", BUILD_LIMIT_S, "a llama-server binary")


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    return llama_server_binary()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def call(url: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> tuple[int, Any]:
    """GET (or POST ``body`` as JSON) and the status with the decoded JSON reply."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw or b"null")
        except ValueError:
            return e.code, raw.decode(errors="replace")


@contextlib.contextmanager
def llama_server(binary: Path, model: Path, *args: str, log: Path) -> Iterator[str]:
    """llama-server on ``model`` at a free local port, ready (/health 200); its URL. Always stopped."""
    port = free_port()
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", "2", *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_LIMIT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"llama-server exited {proc.returncode} before it was ready:\n{log.read_text()}",
                            pytrace=False)
            with contextlib.suppress(OSError):  # refused until it listens; 503 while loading
                if call(f"{url}/health", timeout=2)[0] == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"llama-server was not ready within {READY_LIMIT_S:.0f}s:\n{log.read_text()}",
                            pytrace=False)
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
