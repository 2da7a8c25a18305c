"""``OneShot``: the read commands' blocking client, against a real nats-server, next to ``Bus``.

Each question is asked of both clients and both must answer alike: the same heads, the
same reply, the same error text. OneShot blocks, so it runs in a thread while the test's
loop serves. The CLI's own check: ``ctl status --json`` in a fresh interpreter imports
neither nats-py nor aiohttp nor asyncio.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from live_projector import serving

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus, OneShot, speaks
from llmgw.bus.server import EmbeddedServer
from llmgw.config import Settings
from llmgw.errors import BusError, ConnectError, NoServiceError, PermissionDeniedError, ServiceError

ECHO = "llmgw.test.oneshot.echo"
SILENT = "llmgw.test.oneshot.silent"


def _shot(settings: Settings) -> OneShot:
    return OneShot.connect(settings, "llmgw-test-oneshot")


async def _ask(settings: Settings, subject: str, payload: bytes, **kw: object) -> bytes:
    def ask() -> bytes:
        with _shot(settings) as shot:
            return shot.request(subject, payload, **kw)  # type: ignore[arg-type]

    return await asyncio.to_thread(ask)


async def _echo(data: bytes) -> bytes:
    if data == b"refuse":
        raise ValueError("asked to refuse")
    return b"echo:" + data


async def test_stream_heads_are_the_buses(bus: Bus, settings: Settings) -> None:
    await bus.publish(m.NodeLost(at=m.utcnow(), node="oneshot-n1"))

    def heads() -> dict[str, tuple[int, str]]:
        with _shot(settings) as shot:
            return {s: shot.stream_head(s) for s in subjects.HISTORY_STREAMS}

    got = await asyncio.to_thread(heads)
    assert got == {s: await bus.stream_head(s) for s in subjects.HISTORY_STREAMS}
    assert got[subjects.STREAM_FLEET][0] == 1


async def test_a_missing_stream_is_the_buses_error(bus: Bus, settings: Settings) -> None:
    with pytest.raises(BusError) as by_bus:
        await bus.stream_head("LLMGW_NO_SUCH_STREAM")
    def head() -> tuple[int, str]:
        with _shot(settings) as shot:
            return shot.stream_head("LLMGW_NO_SUCH_STREAM")

    with pytest.raises(BusError) as by_shot:
        await asyncio.to_thread(head)
    assert str(by_shot.value) == str(by_bus.value)
    assert "does not exist" in str(by_shot.value)


async def test_a_service_answers_and_refuses_as_over_the_bus(bus: Bus, settings: Settings) -> None:
    await bus.serve(ECHO, _echo)
    assert await _ask(settings, ECHO, b"hello") == await bus.request(ECHO, b"hello") == b"echo:hello"
    big = os.urandom(300_000)  # more than one read of the socket
    assert await _ask(settings, ECHO, big) == b"echo:" + big
    with pytest.raises(ServiceError) as by_bus:
        await bus.request(ECHO, b"refuse", service="echo service")
    with pytest.raises(ServiceError) as by_shot:
        await _ask(settings, ECHO, b"refuse", service="echo service")
    assert str(by_shot.value) == str(by_bus.value) == "the echo service refused the request: asked to refuse"


async def test_several_questions_on_one_connection(bus: Bus, settings: Settings) -> None:
    await bus.serve(ECHO, _echo)

    def three() -> list[bytes]:
        with _shot(settings) as shot:
            return [shot.request(ECHO, str(i).encode()) for i in range(3)]

    assert await asyncio.to_thread(three) == [b"echo:0", b"echo:1", b"echo:2"]


async def test_no_responders_is_the_buses_error(bus: Bus, settings: Settings) -> None:
    who = "projector (status service; run `llmgw project` or use --replay)"
    with pytest.raises(NoServiceError) as by_bus:
        await bus.request("llmgw.test.oneshot.nobody", b"", service=who)
    with pytest.raises(NoServiceError) as by_shot:
        await _ask(settings, "llmgw.test.oneshot.nobody", b"", service=who)
    assert str(by_shot.value) == str(by_bus.value)
    assert str(by_shot.value).startswith("no projector (status service")


async def test_no_answer_in_time_is_the_buses_error(bus: Bus, settings: Settings) -> None:
    heard: list[bytes] = []

    async def never(msg: object) -> None:
        heard.append(b"")

    await bus.nc.subscribe(SILENT, cb=never)  # a responder that never answers
    await bus.nc.flush()
    with pytest.raises(ServiceError) as by_bus:
        await bus.request(SILENT, b"", timeout=1, service="silent service")
    with pytest.raises(ServiceError) as by_shot:
        await _ask(settings, SILENT, b"", timeout=1, service="silent service")
    assert str(by_shot.value) == str(by_bus.value) == "the silent service did not answer within 1s"
    assert len(heard) == 2


async def test_an_unreachable_server_is_the_buses_error() -> None:
    settings = Settings(nats_url="nats://127.0.0.1:1", connect_timeout_s=1)
    with pytest.raises(ConnectError) as by_bus:
        await Bus.connect(settings, "llmgw-test", reconnect=False)
    with pytest.raises(ConnectError) as by_shot:
        _shot(settings)
    assert str(by_shot.value) == str(by_bus.value)
    assert "cannot reach NATS at nats://127.0.0.1:1" in str(by_shot.value)


def test_websocket_urls_are_left_to_the_bus() -> None:
    assert speaks(Settings(nats_url="nats://a:4222, tls://b:4222"))
    assert not speaks(Settings(nats_url="nats://a:4222,ws://b:8080"))


# --- a server with logins ---------------------------------------------------------------------------

AUTH_CONF = """
authorization {
  users = [
    {user: svc, password: svc-pw}
    {user: cli, password: cli-pw, permissions: {
      publish: {allow: ["%(echo)s", "$JS.API.STREAM.INFO.>"]}
      subscribe: {allow: ["_INBOX.cli.>"]}
    }}
    {nkey: %(nkey)s}
  ]
}
"""


@pytest.fixture(scope="module")
def auth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user nkey seed (``user.nk``) and a stranger's (``stranger.nk``)."""
    import nkeys

    d = tmp_path_factory.mktemp("auth")
    for name in ("user", "stranger"):
        (d / f"{name}.nk").write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER) + b"\n")
    return d


@pytest.fixture(scope="module")
def auth_url(auth_dir: Path) -> Iterator[str]:
    import nkeys

    public = nkeys.from_seed(bytearray((auth_dir / "user.nk").read_bytes().strip())).public_key.decode()
    conf = auth_dir / "nats.conf"
    conf.write_text(AUTH_CONF % {"echo": ECHO, "nkey": public})
    srv = EmbeddedServer(auth_dir / "data", port=0, config_file=conf)
    srv.start()
    try:
        yield f"nats://127.0.0.1:{srv.bound_port}"
    finally:
        srv.stop()


async def test_a_login_gets_its_replies_under_its_own_inbox(auth_url: str) -> None:
    svc = await Bus.connect(Settings(nats_url=auth_url, user="svc", password="svc-pw"), "llmgw-test-svc")
    try:
        await svc.serve(ECHO, _echo)
        cli = Settings(nats_url=auth_url, user="cli", password="cli-pw", request_timeout_s=2)
        # cli may read only _INBOX.cli.>: an answer anywhere else would never come.
        assert await _ask(cli, ECHO, b"x") == b"echo:x"
        with pytest.raises(PermissionDeniedError) as by_shot:
            await _ask(cli, "llmgw.test.oneshot.forbidden", b"")
        assert "NATS refused 'llmgw.test.oneshot.forbidden' for these credentials" in str(by_shot.value)
        assert "permissions violation" in str(by_shot.value)
    finally:
        await svc.close()


@pytest.mark.parametrize("login", [{"user": "cli", "password": "wrong"}, {}])
async def test_a_refused_login_is_the_buses_error(auth_url: str, login: dict[str, str]) -> None:
    settings = Settings(nats_url=auth_url, connect_timeout_s=2, **login)
    with pytest.raises(ConnectError) as by_bus:
        await Bus.connect(settings, "llmgw-test", reconnect=False)
    with pytest.raises(ConnectError) as by_shot:
        _shot(settings)
    assert str(by_shot.value) == str(by_bus.value)
    assert ("refused the credentials" if login else "wants a login") in str(by_shot.value)


async def test_an_nkey_signs_the_servers_nonce(auth_url: str, auth_dir: Path) -> None:
    svc = await Bus.connect(Settings(nats_url=auth_url, user="svc", password="svc-pw"), "llmgw-test-svc")
    try:
        await svc.serve(ECHO, _echo)
        signed = Settings(nats_url=auth_url, nkey_seed_file=str(auth_dir / "user.nk"))
        assert await _ask(signed, ECHO, b"n") == b"echo:n"
        stranger = Settings(nats_url=auth_url, nkey_seed_file=str(auth_dir / "stranger.nk"), connect_timeout_s=2)
        with pytest.raises(ConnectError) as by_bus:
            await Bus.connect(stranger, "llmgw-test", reconnect=False)
        with pytest.raises(ConnectError) as by_shot:
            _shot(stranger)
        assert str(by_shot.value) == str(by_bus.value)
        assert "refused the credentials" in str(by_shot.value)
    finally:
        await svc.close()


# --- the CLI --------------------------------------------------------------------------------------------

PROBE = """
import sys
from llmgw.cli.main import cli
try:
    cli(["ctl", "status", "--json"], prog_name="llmgw")
except SystemExit as e:
    code = e.code
print(sorted(n for n in ("nats", "aiohttp", "asyncio", "uvloop", "rich", "llmgw.fleet") if n in sys.modules),
      file=sys.stderr)
sys.exit(code)
"""


def _probe(settings: Settings) -> tuple[int, str, list[str]]:
    env = dict(os.environ, LLMGW_NATS_URL=settings.nats_url)
    res = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    *text, modules = res.stderr.strip().splitlines()
    return res.returncode, res.stdout + "\n".join(text), json.loads(modules.replace("'", '"'))


async def test_ctl_status_asks_without_nats_py_or_an_event_loop(bus: Bus, settings: Settings, tmp_path: Path) -> None:
    await bus.publish(m.NodeLost(at=m.utcnow(), node="oneshot-n1"))

    def ask() -> tuple[int, str, list[str]]:
        with serving(settings, tmp_path / "live.duckdb", 1):
            return _probe(settings)

    code, out, modules = await asyncio.to_thread(ask)
    assert code == 0, out
    assert json.loads(out)["positions"][subjects.STREAM_FLEET] == 1
    assert modules == []


def test_ctl_status_without_a_projector_says_so_without_nats_py(settings: Settings) -> None:
    code, out, modules = _probe(settings)
    assert code == 1
    assert out.strip() == (f"Error: no projector (status service; run `llmgw project` or use --replay) is running on "
                           f"{settings.nats_url}; start one (`llmgw up` starts them all)")
    assert modules == []
