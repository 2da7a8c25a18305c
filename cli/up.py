"""``llmgw up``: a whole local control plane in one command, each part its own process.

The embedded nats-server (unless ``--nats-url``), then ``llmgw project``,
``planner``, ``scheduler``, ``router``, ``dashboard`` and, with ``--simulate``,
one ``llmgw agent --simulate`` for every node of the file; each a child with
its own event loop and log file. Everything lives in the data directory, so a
second ``up`` with the same directory continues where the first stopped.
Every one of them, nats-server included, is restarted when it dies (nats-server
with the same store and port, so every other child reconnects to it), and the
restart is printed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO

import click

from llmgw.bus import EmbeddedServer
from llmgw.cli.options import run
from llmgw.config import (
    DEFAULT_NATS_URL,
    Settings,
    credentials_path,
    read_credentials,
    write_credentials,
)
from llmgw.engine import llmgw_program
from llmgw.errors import LlmgwError, ServerError
from llmgw.proc import die_with

EXAMPLE_NAME = "qwen14"
EXAMPLE_MODEL = "Qwen/Qwen2.5-14B-Instruct"
MAX_RESTARTS = 5


@dataclass
class Child:
    """One part of the control plane as a child process, restarted if it dies."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    log: IO[bytes] | None = field(default=None, repr=False)
    optional: bool = False  # one that keeps exiting is given up on, and the rest goes on (the dashboard)
    offset: int = 0  # where this run's output starts in the (appended) log

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.offset = self.log.tell()
        # Its own session: Ctrl-C reaches `up` alone, which then stops the children in order.
        # It dies with `up` (PR_SET_PDEATHSIG): after a kill -9 of `up` no part serves on, holds a port, or
        # outlives the gap the next start records.
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env, start_new_session=True, preexec_fn=die_with(os.getpid()))

    def tail(self, n: int = 5) -> str:
        """The last ``n`` lines of this run's output (the log is appended to: earlier runs' are not this one's)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.offset)
                lines = f.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-n:])

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the child's group (engines included), SIGKILL if it lingers."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
            except ProcessLookupError:
                pass
        if self.log is not None:
            self.log.close()
            self.log = None


# How a part that could not bind its port says so (the router's ConfigError, aiohttp's OSError).
_BIND_ERROR = ("address already in use", "cannot listen on", "errno 98", "cannot assign requested address")
LISTEN_OPTIONS = {"router": "--router-listen", "dashboard": "--dashboard-listen"}


def look_line(engines: str) -> str:
    """What to try next: real engines on a simulated card serve the README's tiny demo model, not a 14B."""
    plan = ("llmgw ctl model plan ./models/tiny --context 1024  (after `llmgw demo-model ./models/tiny`)"
            if engines == "real" else "llmgw ctl model plan Qwen/Qwen2.5-14B-Instruct")
    return f"look: llmgw ctl status   |   {plan}   |   llmgw ctl idle"


def check_ports(binds: list[tuple[str, str]]) -> None:
    """Every HOST:PORT ``up`` hands a part, before anything starts: well formed, not one port twice, free."""
    import socket

    from llmgw.cli.router import listen_address

    seen: dict[int, tuple[str, str]] = {}
    for option, value in binds:
        try:
            host, port = listen_address(value)
        except click.BadParameter as e:
            raise LlmgwError(f"{option} {e.message}") from None
        if port and port in seen and (seen[port][1] == host or "0.0.0.0" in (host, seen[port][1])):
            raise LlmgwError(f"{seen[port][0]} and {option} both say {value}; give the dashboard another port")
        seen[port] = (option, host)
        if not port:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                why = "already in use (another llmgw up, router or dashboard?)" if e.errno == 98 else \
                    f"not one to bind here ({e.strerror})"
                raise LlmgwError(f"{option} {value}: the port is {why}; stop what holds it, or give {option} "
                                 "HOST:PORT with another port (port 0: a free one)") from None


def _router_url(router: Child, within_s: float = 10.0) -> str:
    """The URL the router (or dashboard) printed on its first line (the real port when its --listen said 0)."""
    deadline = time.monotonic() + within_s
    while True:  # within_s 0: look once
        try:
            with open(router.log_path, "rb") as f:
                f.seek(router.offset)
                first = f.read(4096).decode(errors="replace").splitlines()[:1]
        except OSError:
            first = []
        if first and first[0].startswith("http"):
            return first[0].strip()
        if (router.proc is not None and router.proc.poll() is not None) or time.monotonic() >= deadline:
            return ""
        time.sleep(0.1)


@dataclass
class NatsChild:
    """The embedded nats-server, supervised like the other children."""

    server: EmbeddedServer
    restarts: int = 0
    due: float = 0.0  # monotonic time of the next restart, while it is down

    def check(self) -> None:
        """Restart a dead server on its port and store (with back-off); raise after MAX_RESTARTS."""
        proc = self.server.proc
        code = proc.poll() if proc is not None else None
        if proc is None or code is None:
            return
        now = time.monotonic()
        if not self.due:
            if self.restarts >= MAX_RESTARTS:
                raise click.ClickException(f"nats-server keeps exiting (code {code}): {self.server.tail()}; "
                                           f"see {self.server.data_dir / 'nats-server.log'}")
            self.restarts += 1
            self.due = now + min(2 ** self.restarts * 0.25, 5)
            click.echo(f"nats-server exited (code {code}): {self.server.tail(2) or 'no log'}; restarting on port "
                       f"{self.server.bound_port} with the same store ({self.restarts}/{MAX_RESTARTS})", err=True)
        if now < self.due:
            return
        self.due = 0.0
        try:
            self.server.restart()
        except ServerError as e:
            click.echo(f"nats-server did not start again: {e}", err=True)
            return  # still dead: the next check counts another restart
        click.echo(f"nats-server is back on {self.server.url}", err=True)


ALIVE_FILE = "up.alive.json"  # in the data directory: this `up`'s boot id, when it was last seen, whether it stopped
ALIVE_EVERY_S = 2.0  # how stale "last seen" may be after a kill -9


@dataclass
class PlaneRecord:
    """`up`'s own stops and starts on the control stream, so that a gap it was down is history too.

    At start it publishes ``ControlPlaneStarted``; while it runs it notes the time in ``ALIVE_FILE`` every
    ALIVE_EVERY_S; stopping, it publishes ``ControlPlaneStopped`` before its parts and its bus go. A run that
    ended without that stop (kill -9) left its last time in the file: the next start carries it (``last_seen``).
    """

    path: Path
    boot_id: str = field(default_factory=lambda: os.urandom(8).hex())
    noted: float = 0.0

    def started(self, settings: Settings) -> str:
        """Publish the start (with the last sign of life of a run that stopped unrecorded); a line for the operator."""
        import json

        from llmgw import ctl
        from llmgw import messages as m

        try:
            before = json.loads(self.path.read_text())
            previous, stopped = str(before.get("boot_id", ""))[:64], bool(before.get("stopped"))
            seen = None if stopped else _parse_time(before.get("seen"))
        except (OSError, ValueError, AttributeError):
            previous, seen = "", None
        run(ctl.publish_control(settings, m.ControlPlaneStarted(at=m.utcnow(), boot_id=self.boot_id,
                                                                previous_boot_id=previous, last_seen=seen)))
        self.alive()
        if seen is not None:
            return f"the last run ({previous}) stopped unrecorded; last seen {seen:%Y-%m-%d %H:%M:%S} UTC: recorded as down since"
        return ""

    def alive(self, stopped: bool = False) -> None:
        import json

        from llmgw import messages as m

        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"boot_id": self.boot_id, "seen": m.utcnow().isoformat(), "stopped": stopped}))
        os.replace(tmp, self.path)
        self.noted = time.monotonic()

    def tick(self) -> None:
        if time.monotonic() - self.noted >= ALIVE_EVERY_S:
            self.alive()

    def stopped(self, settings: Settings, reason: str) -> None:
        """Publish the stop while the bus is still there; a stop that cannot be published is the next start's to say."""
        from llmgw import ctl
        from llmgw import messages as m

        try:
            run(ctl.publish_control(settings, m.ControlPlaneStopped(at=m.utcnow(), boot_id=self.boot_id, reason=reason)))
        except (LlmgwError, click.ClickException, OSError) as e:
            click.echo(f"the stop is not recorded on the bus ({e}); the next `llmgw up` records the gap", err=True)
            return
        self.alive(stopped=True)


def _parse_time(text: object) -> datetime | None:
    if not isinstance(text, str):
        return None
    t = datetime.fromisoformat(text)
    return t if t.tzinfo is not None else None


# Each part of `up` logs in as its role; the simulated agents as one user for the fleet file's nodes.
ROLES = {"project": "projector", "planner": "planner", "scheduler": "scheduler", "router": "router",
         "dashboard": "viewer", "agents": "agent"}
ROUTER_NAME = "router-up"
ROUTER_ACCESS_LOG = "router-access.log"  # in <data dir>/logs/, where `ctl request` looks
AGENTS_USER = "agents-up"


@dataclass
class ClosedBus:
    """The embedded NATS's logins: nats.conf (one user per part), their passwords, who gets which."""

    conf: Path
    passwords: dict[str, str]  # user → password
    creds: Path

    @property
    def server_env(self) -> dict[str, str]:
        """What nats.conf reads the passwords from ($LLMGW_PW_…), the system user's included."""
        from llmgw.bus import natsconf

        return {natsconf.password_env(u): pw for u, pw in self.passwords.items()}

    def login(self, user: str) -> dict[str, str]:
        return {"user": user, "password": self.passwords[user]}

    @property
    def child_env(self) -> dict[str, dict[str, str]]:
        from llmgw.bus import natsconf

        out = {}
        for part, role in ROLES.items():
            user = (AGENTS_USER if role == "agent" else
                    natsconf.user_name("router", ROUTER_NAME) if role == "router" else role)
            out[part] = {"LLMGW_NATS_USER": user, "LLMGW_NATS_PASSWORD": self.passwords[user]}
        return out

    def save(self, nats_url: str) -> None:
        write_credentials(self.creds, nats_url, {u: pw for u, pw in self.passwords.items() if u != "sys"})


def closed_bus(store: Path, nodes: list[str]) -> ClosedBus:
    """nats.conf for `up` (no monitoring port, store in ``store``) and a password per user, kept from
    the last `up` on this directory where there was one (so shells holding them keep working)."""
    from llmgw.bus import natsconf

    users = [u for u, _, _ in natsconf.users(nodes, [ROUTER_NAME])] + [AGENTS_USER, "sys"]
    known = read_credentials(credentials_path(store.parent))
    old = known[1] if known else {}
    passwords = {u: old.get(u) or natsconf.new_password() for u in users}
    store.mkdir(parents=True, exist_ok=True)
    conf = store / "nats.conf"
    conf.write_text(natsconf.render(nodes, routers=[ROUTER_NAME], store_dir=str(store), http_port=None,
                                    agent_group=(AGENTS_USER, nodes) if nodes else None))
    return ClosedBus(conf, passwords, credentials_path(store.parent))


def access_log_arg(given: str | None, logs: Path) -> str:
    """What the router's --access-log gets from ``--router-access-log``: a resolved path, ``-``, or "" (off)."""
    if given == "off":
        return ""
    if given == "-":
        return given
    return str(Path(given).resolve()) if given else str(logs / ROUTER_ACCESS_LOG)


def _default_models_dir() -> str | None:
    env = os.environ.get("LLMGW_MODELS_DIR")
    if env:
        return env
    here = Path("examples/models")
    return str(here.resolve()) if here.is_dir() else None


@click.command("up")
@click.option("--simulate", "fleet_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Also run simulated agents for every node of this fleet file (no GPU; fake engines unless --engines real).")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="JetStream store, DuckDB file and logs [default: $LLMGW_DATA_DIR, else $XDG_DATA_HOME/llmgw, else ~/.local/share/llmgw].")
@click.option("--port", type=click.IntRange(0, 65535), default=4222, show_default=True, help="nats-server port on loopback (0: a free one).")
@click.option("--nats-url", help="Use this running NATS instead of starting one.")
@click.option("--router-listen", default="127.0.0.1:8080", show_default=True, help="Where the OpenAI-compatible router listens.")
@click.option("--router-tick", type=click.FloatRange(0.05, 3600), default=10.0, show_default=True, help="Seconds between the router's idle maps.")
@click.option("--heartbeat-s", type=click.FloatRange(0.1), default=5.0, show_default=True, help="Seconds between simulated agents' heartbeats.")
@click.option("--lost-after", type=click.FloatRange(0.5, 86400), default=30.0, show_default=True, help="Seconds of silence before a node is lost.")
@click.option("--quarantine-faults", type=click.IntRange(0, 10_000), default=3, show_default=True,
              help="GPU faults on one node within --quarantine-window that quarantine it (0: only fatal XIDs do).")
@click.option("--quarantine-window", type=click.FloatRange(1, 7 * 24 * 60), default=60.0, show_default=True,
              help="Minutes over which --quarantine-faults are counted.")
@click.option("--models-dir", help="Org__Name model folders for the planner [default: $LLMGW_MODELS_DIR, else ./examples/models].")
@click.option("--no-example", is_flag=True, help="Do not declare the example model (never declared with --engines real).")
@click.option("--engine-startup-s", type=click.FloatRange(0, 3600), default=2.0, show_default=True,
              help="With --simulate: seconds each fake engine takes to start, so a cold start shows.")
@click.option("--wake-timeout", type=click.FloatRange(0), default=120.0, show_default=True,
              help="Seconds the router holds a request while its parked model wakes.")
@click.option("--router-access-log", metavar="FILE|-|off",
              help="The router's access log, one JSON line per request (`llmgw ctl request ID` searches it) "
                   "[default: <data dir>/logs/router-access.log; - : the router's own log; off: none].")
@click.option("--dashboard-listen", default="127.0.0.1:8081", show_default=True,
              help="Where the web dashboard listens (port 0: a free one; 'off': no dashboard).")
@click.option("--engines", type=click.Choice(["fake", "real"]), default="fake", show_default=True,
              help="With --simulate: fake engines, or the real ones --engine-cmd names, on the simulated GPUs.")
@click.option("--engine-cmd", "engine_cmds", multiple=True, metavar="ENGINE=CMD",
              help="With --engines real: the program for an engine, repeatable (e.g. 'llama.cpp=/path/to/llama-server').")
@click.option("--allow-engine-arg", "allowed_args", multiple=True, metavar="FLAG",
              help="Passed to the simulated agents: start engines with this argument although the allow-list refuses "
                   "it, repeatable (--allow-engine-arg=--log-file).")
@click.option("--allow-model-path", "model_paths", multiple=True, metavar="DIR", envvar="LLMGW_ALLOW_MODEL_PATH",
              type=click.Path(file_okay=False, path_type=Path),
              help="With --simulate: a directory the simulated agents' engines may read model files from besides "
                   "--models-dir and the Hugging Face cache, repeatable [env LLMGW_ALLOW_MODEL_PATH, "
                   "colon-separated; default: ./models, where the README's `llmgw demo-model` writes].")
@click.option("--insecure", is_flag=True,
              help="Run the embedded NATS without logins, as before: any local process may publish as any part.")
@click.option("--api-keys", "api_keys", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Key file (sha256 hex digests, one per line) for the router and the dashboard; off when absent.")
@click.option("--open-dashboard", is_flag=True,
              help="The dashboard without a login: anyone who reaches its port sees the fleet. Without it (and "
                   "without --api-keys) the dashboard asks for the key `up` keeps in <data dir>/dashboard.key.")
def up(fleet_path: Path | None, data_dir: Path | None, port: int, nats_url: str | None, router_listen: str,
       router_tick: float, heartbeat_s: float, lost_after: float, quarantine_faults: int, quarantine_window: float,
       models_dir: str | None, no_example: bool,
       engine_startup_s: float, wake_timeout: float, router_access_log: str | None, dashboard_listen: str,
       engines: str, engine_cmds: tuple[str, ...],
       allowed_args: tuple[str, ...], model_paths: tuple[Path, ...],
       insecure: bool, api_keys: Path | None, open_dashboard: bool) -> None:
    """Run a whole control plane here: NATS, projector, planner, scheduler, router (and simulated agents).

    Example:

        llmgw up --simulate examples/fleet.toml
        llmgw up --simulate examples/cpu.toml --engines real --engine-cmd "llama.cpp=$HOME/.cache/llmgw/…/llama-server"
        llmgw up --data-dir /var/lib/llmgw --port 4222 --router-listen 0.0.0.0:8080 --api-keys keys.sha256
    """
    from llmgw.config import data_dir as default_data_dir
    from llmgw.fleetfile import load as load_fleet

    if fleet_path is not None:
        load_fleet(fleet_path)  # a bad file fails here, once, not as an agent that restarts on it forever
    from llmgw.cli.agent import engines_choice

    if fleet_path is None and (engines == "real" or engine_cmds):
        raise click.UsageError("--engines real and --engine-cmd run engines on simulated GPUs: add --simulate FLEET "
                               "(on GPU nodes run `llmgw agent` there instead)")
    if fleet_path is not None:
        engines = engines_choice(True, engines, engine_cmds)
    from llmgw.engine import parse_engine_cmds

    try:
        parse_engine_cmds(engine_cmds)
    except LlmgwError as e:
        raise click.BadParameter(str(e), param_hint="--engine-cmd") from e
    check_ports([("--router-listen", router_listen),
                 *([("--dashboard-listen", dashboard_listen)] if dashboard_listen != "off" else [])])
    root = (data_dir or default_data_dir()).resolve()
    models_dir = models_dir or _default_models_dir()
    readable = [p.expanduser().resolve() for p in model_paths or (Path("models"),)]
    server = None
    nats: NatsChild | None = None
    children: list[Child] = []
    stop = threading.Event()
    why: list[str] = []  # the signal that stopped it, for the stop's record

    def on_signal(sig: int, _: object) -> None:
        why.append(signal.Signals(sig).name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)

    def rotated(*_: object) -> None:  # logrotate signals `up`: the router holds the access log open
        for c in children:
            # Only to a router that serves (it printed its URL after its handler was in place): before
            # that SIGUSR1 would end it, and the log it is about to open is the new one anyway.
            if c.name == "router" and c.proc is not None and c.proc.poll() is None and _router_url(c, 0):
                c.proc.send_signal(signal.SIGUSR1)

    signal.signal(signal.SIGUSR1, rotated)  # from the start: SIGUSR1's default would end `up`
    plane = PlaneRecord(root / ALIVE_FILE)
    recorded = False  # the start is on the bus: the stop must be too
    logins: dict[str, dict[str, str]] = {}  # part → the environment that logs it in
    admin = Settings.from_env(nats_url=nats_url) if nats_url is not None else None
    try:
        if nats_url is None:
            nodes = [n.name for n in load_fleet(fleet_path).nodes] if fleet_path is not None else []
            auth = None if insecure else closed_bus(root / "nats", nodes)
            server = EmbeddedServer(root / "nats", port=port, config_file=auth.conf if auth else None,
                                    env=auth.server_env if auth else None, dies_with_starter=True).start()
            nats_url = server.url
            nats = NatsChild(server)
            if auth is not None:
                auth.save(nats_url)
                logins = auth.child_env
            admin = Settings.from_env(nats_url=nats_url, **auth.login("admin")) if auth else Settings.from_env(
                nats_url=nats_url)
            click.echo(f"nats: {nats_url} (JetStream store {root / 'nats'}; "
                       + (f"closed: one login per part, in {credentials_path(root)})" if auth else
                          "OPEN: --insecure, any local process may publish as any part)"))
        else:
            click.echo(f"nats: {nats_url}")
        click.echo(f"data: {root}  (llmgw.duckdb, logs/{', nats/' if server else ''}; --data-dir or LLMGW_DATA_DIR moves it)")
        from llmgw import ctl

        assert admin is not None
        note = run(ctl.prepare_up(admin,
                                  # The example is a vLLM model: a real engine would fail on it, over and over.
                                  fleet_path if not (no_example or engines == "real") else None,
                                  models_dir, name=EXAMPLE_NAME, model=EXAMPLE_MODEL))
        try:
            gap = plane.started(admin)
            recorded = True
        except LlmgwError as e:  # the control plane runs unrecorded rather than not at all
            gap = f"the start is not recorded on the bus ({e}); `ctl status --at` will not know of this run's gaps"
        if gap:
            click.echo(gap, err=True)
        env = dict(os.environ, LLMGW_NATS_URL=nats_url)
        if models_dir:
            env["LLMGW_MODELS_DIR"] = models_dir
        exe = llmgw_program()
        logs = root / "logs"
        keys = ["--api-keys", str(api_keys.resolve())] if api_keys else []
        access_log = access_log_arg(router_access_log, logs)
        parts = [
            ("project", ["project", "--db", str(root / "llmgw.duckdb")]),
            ("planner", ["planner"]),
            ("scheduler", ["scheduler", "--heartbeat-timeout", f"{lost_after:g}", "--quarantine-faults",
                           str(quarantine_faults), "--quarantine-window", f"{quarantine_window:g}"]),
            ("router", ["router", "--listen", router_listen, "--name", "router-up", "--tick", f"{router_tick:g}",
                        "--wake-timeout", f"{wake_timeout:g}", "--quota-journal", str(root / f"{ROUTER_NAME}.journal"),
                        *keys, *(["--access-log", access_log] if access_log else [])]),
        ]
        board_key: Path | None = None  # the key file a closed dashboard asks for, when up made it
        if dashboard_listen != "off":
            board_keys = keys
            if not api_keys and not open_dashboard:  # closed like the bus: a login up makes once
                from llmgw.apikeys import dashboard_login

                board_key, digests = dashboard_login(root)
                board_keys = ["--api-keys", str(digests)]
            parts.append(("dashboard", ["dashboard", "--listen", dashboard_listen, *board_keys]))
        if fleet_path is not None:
            parts.append(("agents", ["agent", "--simulate", str(fleet_path.resolve()), "--heartbeat-s", f"{heartbeat_s:g}",
                                     "--engine-startup-s", f"{engine_startup_s:g}", "--engines", engines,
                                     *(a for c in engine_cmds for a in ("--engine-cmd", c)),
                                     *(f"--allow-engine-arg={a}" for a in allowed_args),
                                     *(f"--allow-model-path={p}" for p in readable),
                                     "--log-dir", str(logs / "engines")]))
        for name, args in parts:
            child = Child(name, [*exe, *args], logs / f"{name}.log", {**env, **logins.get(name, {})},
                          optional=name == "dashboard")
            child.start()
            children.append(child)
        if note:
            click.echo(note)
        router = children[3]
        router_url = _router_url(router)
        if router_url or (router.proc is not None and router.proc.poll() is None):
            click.echo(f"router: {router_url or f'http://{router_listen}'}/v1  (OpenAI API; models at /v1/models)")
        else:  # it exited before it said where it listens: the URL would be someone else's server
            click.echo(f"router: not serving ({router.tail(1) or 'no output'}); see {router.log_path}")
        board = next((c for c in children if c.name == "dashboard"), None)
        if board is not None:
            board_url = _router_url(board)
            login = (f"  (log in with the key in {board_key})" if board_key else
                     "  (OPEN: --open-dashboard, no login)" if open_dashboard and not api_keys else "")
            click.echo(f"dashboard: {board_url}{login}" if board_url else
                       f"dashboard: not serving ({board.tail(1) or 'no output'}); see {board.log_path}")
        shown = [*(["engines: engines/<replica>.log"] if fleet_path is not None else []),
                 *([f"requests: {Path(access_log).name if Path(access_log).parent == logs else access_log}"]
                   if access_log not in ("", "-") else [])]
        click.echo(f"logs: {logs}/" + (f"  ({'; '.join(shown)})" if shown else ""))
        exports = [f"LLMGW_NATS_URL={nats_url}"] if nats_url != DEFAULT_NATS_URL else []
        if root != default_data_dir().resolve():
            exports.append(f"LLMGW_DATA_DIR={root}")
        if exports:
            click.echo(f"export {' '.join(exports)}   # so the commands below find this NATS"
                       + (", its logins" if logins else "") + (" and its DuckDB file (llmgw export)"
                                                               if root != default_data_dir().resolve() else ""))
        click.echo(look_line(engines))
        click.echo("Ctrl-C stops everything", err=True)
        while not stop.wait(0.5):
            plane.tick()
            if nats is not None:
                nats.check()
            for child in children:
                code = child.proc.poll() if child.proc else None
                if code is None:
                    continue
                said = child.tail(3)
                if child.name in LISTEN_OPTIONS and any(b in said.lower() for b in _BIND_ERROR):
                    # Its port was taken after the check: no restart binds it either.
                    option = LISTEN_OPTIONS[child.name]
                    said = said.replace("pick another --listen", f"pick another {option}")
                    raise click.ClickException(f"{child.name} could not bind its port ({said}); free it, or give "
                                               f"{option} HOST:PORT with another port (port 0: a free one)")
                if child.restarts >= MAX_RESTARTS and child.optional:
                    click.echo(f"{child.name} keeps exiting (code {code}): {child.tail(2)}; going on without it "
                               f"(see {child.log_path})", err=True)
                    child.stop()
                    child.proc = None
                    continue
                if child.restarts >= MAX_RESTARTS:
                    raise click.ClickException(f"{child.name} keeps exiting (code {code}): {child.tail()}; see {child.log_path}")
                child.restarts += 1
                click.echo(f"{child.name} exited (code {code}): {child.tail(2)}; restarting ({child.restarts}/{MAX_RESTARTS})", err=True)
                child.stop()
                time.sleep(min(2 ** child.restarts * 0.25, 5))
                child.start()
    finally:
        if recorded and admin is not None:  # before anything goes: from now on nothing serves
            plane.stopped(admin, why[0] if why else "exited")
        # Agents first (they stop their engines), then the readers, NATS last so nothing loses its bus.
        for child in reversed(children):
            child.stop()
        if server is not None:
            server.stop()
        if children or server:
            click.echo("stopped", err=True)
