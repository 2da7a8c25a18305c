"""Settings every process shares: where NATS is and how to log in to it.

Read from flags first, then ``LLMGW_*`` environment variables, then the ``nats``
CLI's own ``NATS_URL`` and ``NATS_CREDS`` (so a shell set up for ``nats`` works
as is), then defaults.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from llmgw.errors import ConfigError

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def data_dir() -> Path:
    """Where ``llmgw up``/``llmgw nats`` keep JetStream and DuckDB files by default."""
    if env := os.environ.get("LLMGW_DATA_DIR"):
        return Path(env)
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "llmgw"


def credentials_path(root: Path | None = None) -> Path:
    """Where ``llmgw up`` keeps the logins of its NATS (0600): ``<data dir>/nats/credentials.json``."""
    return (root or data_dir()) / "nats" / "credentials.json"


def write_credentials(path: Path, nats_url: str, passwords: dict[str, str]) -> None:
    """Write ``up``'s logins (user → password) for ``nats_url``, readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A fresh file of our own (0600), never a name someone could have planted a link under.
    fd, tmp = tempfile.mkstemp(prefix=".credentials-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"url": nats_url, "users": passwords}, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_credentials(path: Path) -> tuple[str, dict[str, str]] | None:
    """(NATS URL, user → password) from a file ``write_credentials`` wrote; None when there is none."""
    try:
        data = json.loads(path.read_text())
        url, users = data["url"], data["users"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(url, str) or not isinstance(users, dict):
        return None
    return url, {k: v for k, v in users.items() if isinstance(k, str) and isinstance(v, str)}


def local_login(nats_url: str, role: str = "cli") -> tuple[str, str] | None:
    """The login ``llmgw up`` made for ``role`` on its NATS, when that is the NATS asked for."""
    found = read_credentials(credentials_path())
    if found is None or found[0] != nats_url or role not in found[1]:
        return None
    return role, found[1][role]


@dataclass(frozen=True)
class Settings:
    """How to reach NATS; everything optional but the URL."""

    nats_url: str = DEFAULT_NATS_URL
    creds_file: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    nkey_seed_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    stream_replicas: int = 1
    connect_timeout_s: float = 3.0
    request_timeout_s: float = 5.0
    local: bool = False  # the login came from `llmgw up`'s data directory (``with_local_login``)

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        """Settings from ``LLMGW_*`` variables, with explicit values (not None) winning."""
        env = os.environ
        replicas_raw = env.get("LLMGW_STREAM_REPLICAS", "1")
        try:
            replicas = int(replicas_raw)
        except ValueError as e:
            raise ConfigError(f"LLMGW_STREAM_REPLICAS must be 1, 3 or 5 (got {replicas_raw!r})") from e
        base = cls(
            nats_url=env.get("LLMGW_NATS_URL") or env.get("NATS_URL") or DEFAULT_NATS_URL,
            creds_file=env.get("LLMGW_NATS_CREDS") or env.get("NATS_CREDS") or None,
            user=env.get("LLMGW_NATS_USER") or None,
            password=env.get("LLMGW_NATS_PASSWORD") or None,
            nkey_seed_file=env.get("LLMGW_NATS_NKEY") or None,
            tls_ca=env.get("LLMGW_NATS_TLS_CA") or None,
            tls_cert=env.get("LLMGW_NATS_TLS_CERT") or None,
            tls_key=env.get("LLMGW_NATS_TLS_KEY") or None,
            stream_replicas=replicas,
        )
        settings = replace(base, **{k: v for k, v in overrides.items() if v is not None})
        settings = settings.with_local_login()
        settings.validate()
        return settings

    def with_local_login(self, role: str = "cli") -> Settings:
        """With no login of its own, the one ``llmgw up`` wrote into the data directory for ``role``
        (its NATS is closed by default); as it is otherwise. An up login already chosen is swapped."""
        if self.creds_file or self.nkey_seed_file or (self.user and not self.local):
            return self
        login = local_login(self.nats_url, role)
        if login is None:
            return self
        return replace(self, user=login[0], password=login[1], local=True)

    def validate(self) -> None:
        if self.stream_replicas not in (1, 3, 5):
            raise ConfigError(
                f"stream replicas must be 1 (a single server) or 3/5 (a cluster), got {self.stream_replicas}"
            )
        for name in ("creds_file", "nkey_seed_file", "tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"{name.replace('_', ' ')} {path} does not exist")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("TLS client auth needs both a certificate and a key (--tls-cert and --tls-key)")

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert) or self.nats_url.startswith("tls://")
