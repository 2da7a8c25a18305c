"""``llmgw nats``: a server nats-py can use with JetStream, and clear errors when it cannot start."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from llmgw import subjects
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.config import Settings


def test_llmgw_nats_starts_jetstream_with_the_streams_and_stops_cleanly(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw.cli.main", "nats", "--port", "0", "--data-dir", str(tmp_path / "js")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("nats-server listening on nats://127.0.0.1:"), line
        url = line.split()[3]

        async def check() -> list[str]:
            bus = await Bus.connect(Settings(nats_url=url), "t", reconnect=False)
            try:
                names = [(await bus.js.stream_info(s.name)).config.name or "" for s in subjects.STREAMS]
                await bus.ensure_streams()  # re-declaring changes nothing and does not fail
                return names
            finally:
                await bus.close()

        assert asyncio.run(check()) == [s.name for s in subjects.STREAMS]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0
        assert "nats-server stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_a_port_in_use_is_one_error_line_and_exit_1(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = CliRunner().invoke(cli, ["nats", "--port", str(port), "--data-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: port {port} on 127.0.0.1 is already in use;")
    assert "Traceback" not in result.output
