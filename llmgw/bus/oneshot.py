"""One question over NATS, without nats-py: the client ``ctl``'s read commands ask with.

``ctl status`` asks four things (three ``STREAM.INFO`` and the status service) and
exits. nats-py costs more to import than the rest of the command (asyncio, its
JetStream dataclasses, ``email``, its version read from package metadata), so
these questions go over a plain blocking socket: INFO, CONNECT with the same
login as ``Bus.connect`` (user and password, a token in the URL, a creds file or an
nkey seed signing the server's nonce), TLS when the URL or the settings ask for it
or the server requires it, replies under the same inbox prefix, and the same
errors as ``Bus.request`` and ``Bus.stream_head``. Everything that publishes,
reads a stream or stays connected uses ``Bus``; so does a ``ws://`` URL
(``speaks`` says which).
"""

from __future__ import annotations

import base64
import json
import os
import socket
import time
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import urlsplit

import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.errors import BusError, ConnectError, NoServiceError, PermissionDeniedError, ServiceError

if TYPE_CHECKING:
    import ssl

    from llmgw.config import Settings

MAX_LINE = 64 * 1024  # a control line (INFO with a long server list, an -ERR): never more than this
MAX_PAYLOAD = 64 << 20  # nats-server's own ceiling for max_payload
PROTOCOL_VERSION = "1"


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """The client's TLS context (CA, client certificate), or None when the settings ask for no TLS."""
    if not settings.uses_tls:
        return None
    import ssl

    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=settings.tls_ca)
    if settings.tls_cert and settings.tls_key:
        ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
    return ctx


def describe_connect_error(settings: Settings, text: str, *, auth: bool = False, tls: bool = False) -> str:
    """What to do about a connection that failed with ``text``: the sentence both clients give."""
    url = settings.nats_url
    if auth or "authorization" in text.lower():
        if not (settings.user or settings.creds_file or settings.nkey_seed_file):
            return (f"NATS at {url} wants a login and none was given; for `llmgw up`'s NATS set LLMGW_DATA_DIR to "
                    "its data directory (it keeps the logins in nats/credentials.json), else give "
                    "--nats-user/--nats-password or --nats-creds (LLMGW_NATS_USER, LLMGW_NATS_CREDS)")
        return f"NATS at {url} refused the credentials; check --nats-creds/--nats-user (LLMGW_NATS_CREDS, LLMGW_NATS_USER)"
    if tls or "ssl" in text.lower() or "certificate" in text.lower():
        return f"TLS to NATS at {url} failed ({text}); check --tls-ca/--tls-cert/--tls-key"
    return f"cannot reach NATS at {url}; start one with `llmgw nats` or `llmgw up`, or point --nats-url (LLMGW_NATS_URL) at a running server"


def servers(settings: Settings) -> list[str]:
    """The URLs of ``settings.nats_url``, in the order given."""
    return [u.strip() for u in settings.nats_url.split(",") if u.strip()]


def speaks(settings: Settings) -> bool:
    """Whether ``OneShot`` can reach these servers (plain TCP or TLS; websockets are nats-py's)."""
    return all(not u.startswith(("ws://", "wss://")) for u in servers(settings))


class _ServerInfo(msgspec.Struct):
    max_payload: Annotated[int, msgspec.Meta(ge=0)] = 1 << 20
    tls_required: bool = False
    auth_required: bool = False
    headers: bool = False
    nonce: Annotated[str, msgspec.Meta(max_length=1024)] = ""


class _ApiError(msgspec.Struct):
    code: Annotated[int, msgspec.Meta(ge=0, le=999)] = 0
    err_code: Annotated[int, msgspec.Meta(ge=0, le=1 << 31)] = 0
    description: Annotated[str, msgspec.Meta(max_length=4096)] = ""


class _StreamState(msgspec.Struct):
    last_seq: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] = 0


class _StreamInfo(msgspec.Struct):
    state: _StreamState | None = None
    created: Annotated[str, msgspec.Meta(max_length=64)] = ""
    error: _ApiError | None = None


_INFO = msgspec.json.Decoder(_ServerInfo)
_STREAM_INFO = msgspec.json.Decoder(_StreamInfo)
_STREAM_NOT_FOUND = 10059


class _Closed(Exception):
    """The server closed the connection (or it broke) mid-question."""


class OneShot:
    """A blocking NATS connection for a few requests: connect, ask, close."""

    def __init__(self, sock: socket.socket, settings: Settings, info: _ServerInfo) -> None:
        self.sock = sock
        self.settings = settings
        self.info = info
        self.buf = bytearray()
        prefix = subjects.inbox_prefix(settings.user) if settings.user else "_INBOX"
        self.inbox = f"{prefix}.{base64.b32encode(os.urandom(10)).decode().rstrip('=')}"
        self.asked = 0
        self.subscribed = False
        self.errors: list[str] = []  # -ERR lines the server sent that ended nothing by themselves

    # --- connection ------------------------------------------------------------

    @classmethod
    def connect(cls, settings: Settings, name: str) -> OneShot:
        """Log in to the first server that answers, or raise ConnectError with what to do next."""
        failure = ""
        auth = tls = False
        for url in servers(settings):
            try:
                return cls._connect_one(settings, name, url)
            except _LoginRefused as e:
                failure, auth = str(e), True
                break  # another server of the same cluster would refuse it too
            except _TlsFailed as e:
                failure, tls = str(e), True
            except (OSError, _Closed, msgspec.DecodeError) as e:
                failure = str(e) or type(e).__name__
        raise ConnectError(describe_connect_error(settings, failure, auth=auth, tls=tls))

    @classmethod
    def _connect_one(cls, settings: Settings, name: str, url: str) -> OneShot:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        host, port = parts.hostname or "127.0.0.1", parts.port or 4222
        deadline = time.monotonic() + settings.connect_timeout_s
        # An ASCII name as bytes: a str goes through the idna codec, whose import costs more than the connect.
        sock = socket.create_connection((host.encode() if host.isascii() else host, port),  # type: ignore[arg-type]
                                        timeout=settings.connect_timeout_s)
        shot = cls(sock, settings, _ServerInfo())
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            op, rest = shot._control(deadline)
            if op != b"INFO":
                raise _Closed(f"the server said {op!r} where INFO comes first")
            shot.info = _INFO.decode(rest)
            ctx = tls_context(settings)
            if shot.info.tls_required or ctx is not None or parts.scheme == "tls":
                shot._start_tls(ctx, host, deadline)
            shot._send(b"CONNECT " + json.dumps(shot._login(name, parts), sort_keys=True).encode() + b"\r\nPING\r\n")
            while True:
                op, rest = shot._control(deadline)
                if op == b"PONG":
                    return shot
                if op == b"-ERR":
                    text = rest.decode(errors="replace").strip().strip("'")
                    if "authorization" in text.lower() or "authentication" in text.lower():
                        raise _LoginRefused(text)
                    raise _Closed(text)
                if op == b"PING":
                    shot._send(b"PONG\r\n")
        except BaseException:
            shot.close()  # the TLS socket, once wrapped (closing it closes the one below)
            sock.close()
            raise

    def _start_tls(self, ctx: ssl.SSLContext | None, host: str, deadline: float) -> None:
        import ssl

        ctx = ctx or ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        try:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            self.sock = ctx.wrap_socket(self.sock, server_hostname=host)
        except ssl.SSLError as e:
            raise _TlsFailed(str(e)) from e

    def _login(self, name: str, parts: Any) -> dict[str, Any]:
        s = self.settings
        opts: dict[str, Any] = {"verbose": False, "pedantic": False, "lang": "python3", "version": "llmgw-oneshot",
                                "protocol": 1, "name": name, "headers": True, "no_responders": True}
        if s.creds_file or s.nkey_seed_file:
            jwt, seed = _read_creds(s.creds_file) if s.creds_file else (None, _read_seed(s.nkey_seed_file or ""))
            import nkeys

            kp = nkeys.from_seed(bytearray(seed))
            try:
                opts["sig"] = base64.b64encode(kp.sign(self.info.nonce.encode())).decode()
                if jwt is not None:
                    opts["jwt"] = jwt.decode()
                else:
                    opts["nkey"] = kp.public_key.decode()
            finally:
                kp.wipe()
        elif s.user is not None:
            opts["user"], opts["pass"] = s.user, s.password or ""
        elif parts.username is not None:
            if parts.password is None:
                opts["auth_token"] = parts.username
            else:
                opts["user"], opts["pass"] = parts.username, parts.password
        return opts

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> OneShot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- questions --------------------------------------------------------------

    def request(self, subject: str, payload: bytes, *, timeout: float | None = None, service: str = "") -> bytes:  # noqa: ASYNC109 - blocking, bounded
        """Ask a service; the same answers and errors as ``Bus.request``."""
        timeout = timeout or self.settings.request_timeout_s
        who = service or subject
        try:
            data = self._ask(subject, payload, timeout)
        except _NoResponders as e:
            raise NoServiceError(f"no {who} is running on {self.settings.nats_url}; start one (`llmgw up` starts them all)") from e
        except TimeoutError as e:
            raise ServiceError(f"the {who} did not answer within {timeout:.0f}s") from e
        except (_Closed, OSError) as e:
            raise ServiceError(f"the NATS connection closed while asking the {who}") from e
        if data.startswith(b'{"type":"error"'):
            try:
                err = m.ERROR_DECODER.decode(data)
            except msgspec.DecodeError:
                pass
            else:
                raise ServiceError(f"the {who} refused the request: {err.error}")
        return data

    def stream_last_seq(self, stream: str) -> int:
        """The last sequence stored in a stream (0 when empty), as ``Bus.stream_last_seq``."""
        return self.stream_head(stream)[0]

    def stream_head(self, stream: str) -> tuple[int, str]:
        """A stream's last sequence and when JetStream created it, as ``Bus.stream_head``."""
        try:
            data = self._ask(subjects.js_stream("INFO", stream), b"", self.settings.request_timeout_s)
            info = _STREAM_INFO.decode(data)
        except (_NoResponders, TimeoutError, _Closed, OSError) as e:
            raise BusError(f"JetStream did not answer for stream {stream}") from e
        except msgspec.DecodeError as e:
            raise BusError(f"JetStream's answer for stream {stream} is not a stream's info ({e})") from e
        if info.error is not None:
            if info.error.err_code == _STREAM_NOT_FOUND or info.error.code == 404:
                raise BusError(f"stream {stream} does not exist; start the control plane once (`llmgw up`) to declare it")
            raise BusError(f"JetStream refused the info of stream {stream}: {info.error.description} "
                           f"(code {info.error.err_code})")
        return (info.state.last_seq if info.state else 0), _created(info.created)

    def _ask(self, subject: str, payload: bytes, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        if not self.subscribed:
            self._send(f"SUB {self.inbox}.* 1\r\n".encode())
            self.subscribed = True
        self.asked += 1
        reply = f"{self.inbox}.{self.asked}".encode()
        self._send(b"PUB %s %s %d\r\n%s\r\n" % (subject.encode(), reply, len(payload), payload))
        while True:
            op, rest = self._control(deadline)
            if op in (b"MSG", b"HMSG"):
                got, headers, data = self._message(op, rest, deadline)
                if got != reply:
                    continue  # a late answer to an earlier question
                if headers is not None and headers[9:12] == b"503" and not data:
                    raise _NoResponders(subject)
                return data
            if op == b"PING":
                self._send(b"PONG\r\n")
            elif op == b"-ERR":
                text = rest.decode(errors="replace").strip().strip("'")
                if "permissions violation" in text.lower():
                    raise PermissionDeniedError(f"NATS refused {subject!r} for these credentials (nats: {text.lower()}); "
                                                "check the user's permissions in nats.conf")
                self.errors.append(text)

    # --- the wire ---------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        self.sock.settimeout(left)
        try:
            chunk = self.sock.recv(256 * 1024)
        except TimeoutError:
            raise
        except OSError as e:
            if "timed out" in str(e):  # an SSL socket's timeout
                raise TimeoutError from e
            raise
        if not chunk:
            raise _Closed("the server closed the connection")
        self.buf += chunk

    def _control(self, deadline: float) -> tuple[bytes, bytes]:
        """The next control line: (operation, the rest of the line)."""
        while (eol := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > MAX_LINE:
                raise _Closed(f"a control line longer than {MAX_LINE} bytes")
            self._fill(deadline)
        line = bytes(self.buf[:eol])
        del self.buf[: eol + 2]
        op, _, rest = line.partition(b" ")
        return op.upper(), rest

    def _message(self, op: bytes, rest: bytes, deadline: float) -> tuple[bytes, bytes | None, bytes]:
        """The rest of a MSG or HMSG: (reply-to subject it came on, its header block or None, its payload)."""
        args = rest.split()
        try:
            if op == b"HMSG":
                header_size, total = int(args[-2]), int(args[-1])
            else:
                header_size, total = 0, int(args[-1])
        except (ValueError, IndexError) as e:
            raise _Closed(f"a malformed {op.decode()} line") from e
        if not 0 <= header_size <= total <= MAX_PAYLOAD:
            raise _Closed(f"a {op.decode()} of {total} bytes (at most {MAX_PAYLOAD})")
        while len(self.buf) < total + 2:
            self._fill(deadline)
        body = bytes(self.buf[:total])
        del self.buf[: total + 2]
        headers = body[:header_size] if op == b"HMSG" else None
        return args[0], headers, body[header_size:]


class _LoginRefused(Exception):
    pass


class _TlsFailed(Exception):
    pass


class _NoResponders(Exception):
    pass


def _read_creds(path: str) -> tuple[bytes, bytes]:
    """(user JWT, user seed) of a NATS creds file."""
    lines = [line.strip() for line in open(path, "rb").read().splitlines()]  # noqa: SIM115 - read once, small
    jwt = seed = b""
    for i, line in enumerate(lines[:-1]):
        if b"BEGIN NATS USER JWT" in line and not jwt:
            jwt = lines[i + 1]
        elif b"BEGIN USER NKEY SEED" in line and not seed:
            seed = lines[i + 1]
    if not jwt or not seed:
        from llmgw.errors import ConfigError

        raise ConfigError(f"{path} is not a NATS creds file (it needs a user JWT and a user nkey seed)")
    return jwt, seed


def _created(text: str) -> str:
    """JetStream's RFC 3339 time (nanoseconds, ``Z``) as ``Bus.stream_head`` gives it: ISO 8601, microseconds."""
    from datetime import datetime

    stamp, _, zone = text.rstrip("Z").partition("+")
    whole, dot, fraction = stamp.partition(".")
    try:
        return datetime.fromisoformat(f"{whole}{dot}{fraction[:6]}+{zone or '00:00'}").isoformat()
    except ValueError:
        return text


def _read_seed(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read().strip()
