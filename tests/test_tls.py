"""TLS to NATS with the documented settings, against a throwaway CA made here with the openssl CLI."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus, natsconf
from llmgw.bus.server import EmbeddedServer
from llmgw.config import Settings
from llmgw.errors import ConnectError

OPENSSL = shutil.which("openssl")


def _ssl(*args: str, cwd: Path) -> None:
    assert OPENSSL is not None, "the TLS tests need the openssl CLI (the cryptography package is not installed)"
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    _ssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}", cwd=d)
    return d / f"{name}.pem", d / f"{name}.key"


def issue(d: Path, ca: tuple[Path, Path], name: str, ext: str) -> tuple[Path, Path]:
    (d / f"{name}.ext").write_text(ext + "\n")
    _ssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _ssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
         "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)
    return d / f"{name}.pem", d / f"{name}.key"


@dataclass
class Pki:
    ca: Path
    client: tuple[Path, Path]
    other_ca: Path
    stranger: tuple[Path, Path]  # a client certificate from the other CA
    url: str


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pki]:
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d, "ca")
    server = issue(d, ca, "server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth")
    client = issue(d, ca, "client", "extendedKeyUsage=clientAuth")
    other = make_ca(d, "other-ca")
    stranger = issue(d, other, "stranger", "extendedKeyUsage=clientAuth")
    conf = d / "nats.conf"
    conf.write_text(natsconf.tls_block(str(ca[0]), str(server[0]), str(server[1]), verify=True))
    srv = EmbeddedServer(d / "data", port=0, config_file=conf)
    srv.start()
    try:
        yield Pki(ca[0], client, other[0], stranger, f"tls://127.0.0.1:{srv.bound_port}")
    finally:
        srv.stop()


def settings(pki: Pki, ca: Path, cert: tuple[Path, Path] | None) -> Settings:
    return Settings(nats_url=pki.url, tls_ca=str(ca), tls_cert=str(cert[0]) if cert else None,
                    tls_key=str(cert[1]) if cert else None, connect_timeout_s=2)


async def test_tls_with_client_certificate_publishes_and_reads(pki: Pki) -> None:
    s = settings(pki, pki.ca, pki.client)
    s.validate()
    bus = await Bus.connect(s, "test-tls", reconnect=False)
    try:
        await bus.ensure_streams()
        ack = await bus.publish(m.NodeLost(at=m.utcnow(), node="tls-node"))
        assert ack.stream == subjects.STREAM_FLEET and ack.seq >= 1
        assert bus.nc.connected_url is not None and bus.nc.connected_url.scheme == "tls"
    finally:
        await bus.close()


async def test_wrong_ca_is_a_clear_connect_error(pki: Pki) -> None:
    with pytest.raises(ConnectError, match=r"TLS to NATS at tls://127\.0\.0\.1:\d+ failed .*--tls-ca"):
        await Bus.connect(settings(pki, pki.other_ca, pki.client), "test-tls-wrong-ca", reconnect=False)


async def test_client_without_a_trusted_certificate_is_refused(pki: Pki) -> None:
    for cert in (None, pki.stranger):
        with pytest.raises(ConnectError):
            await Bus.connect(settings(pki, pki.ca, cert), "test-tls-no-cert", reconnect=False)


def test_tls_settings_need_cert_and_key_together(pki: Pki) -> None:
    from llmgw.errors import ConfigError

    with pytest.raises(ConfigError, match="both a certificate and a key"):
        Settings(nats_url=pki.url, tls_ca=str(pki.ca), tls_cert=str(pki.client[0])).validate()


async def test_the_read_commands_client_speaks_tls_as_the_bus_does(pki: Pki) -> None:
    import asyncio

    from llmgw.bus import OneShot

    s = settings(pki, pki.ca, pki.client)
    bus = await Bus.connect(s, "test-tls-oneshot", reconnect=False)
    try:
        await bus.ensure_streams()
        await bus.publish(m.NodeLost(at=m.utcnow(), node="tls-oneshot"))

        def head() -> tuple[int, str]:
            with OneShot.connect(s, "test-tls-oneshot") as shot:
                return shot.stream_head(subjects.STREAM_FLEET)

        assert await asyncio.to_thread(head) == await bus.stream_head(subjects.STREAM_FLEET)
    finally:
        await bus.close()
    for ca, cert in ((pki.other_ca, pki.client), (pki.ca, None)):
        wrong = settings(pki, ca, cert)
        with pytest.raises(ConnectError) as by_bus:
            await Bus.connect(wrong, "test-tls-wrong", reconnect=False)
        with pytest.raises(ConnectError) as by_shot:
            OneShot.connect(wrong, "test-tls-wrong")
        if ca == pki.other_ca:
            assert str(by_shot.value).startswith(f"TLS to NATS at {pki.url} failed (")
            assert str(by_bus.value).startswith(f"TLS to NATS at {pki.url} failed (")
