"""API keys, as the router and the dashboard check them: a file of SHA-256 digests, never the keys."""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from llmgw.errors import ConfigError


def load_api_keys(path: str | Path) -> frozenset[str]:
    """SHA-256 hex digests, one per line; ``#`` starts a comment. Raises ConfigError."""
    p = Path(path)
    try:
        text = p.read_text(encoding="ascii")
    except OSError as e:
        raise ConfigError(f"cannot read API key file {p} ({e.strerror}); pass a file of sha256 hex digests, one per line") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p} is not text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                          "write sha256 hex digests, one per line") from None
    keys = set()
    for n, line in enumerate(text.splitlines(), 1):
        digest = line.split("#", 1)[0].strip().lower()
        if not digest:
            continue
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ConfigError(
                f"{p}:{n}: not a sha256 hex digest ({len(digest)} characters); "
                "write `printf %s \"$KEY\" | sha256sum` output, one per line"
            )
        keys.add(digest)
    if not keys:
        raise ConfigError(f"{p} holds no keys; add sha256 hex digests or drop --api-keys")
    return frozenset(keys)


def hash_key(key: str) -> str:
    """The digest an API key file stores for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


DASHBOARD_KEY = "dashboard.key"  # in ``llmgw up``'s data directory: the secret, for whoever runs it
DASHBOARD_DIGEST = "dashboard.sha256"  # beside it: its digest, the dashboard's --api-keys file


def dashboard_login(data_dir: Path) -> tuple[Path, Path]:
    """The key ``llmgw up``'s dashboard asks for, made once per data directory: (key file, digest file).

    The key file is the owner's alone (0600, as the bus's logins are); a later ``up`` keeps it, so a
    browser's session and a script's key outlive restarts. Delete both files to make a new one.
    """
    key_path, digest_path = data_dir / DASHBOARD_KEY, data_dir / DASHBOARD_DIGEST
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        key = key_path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        key = f"dashboard-{secrets.token_urlsafe(32)}"  # not llmgw-…: that is a ctl key's form
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(key + "\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the dashboard's key {key_path} ({e}); delete it and {digest_path} "
                          "to make a new one") from e
    if not key:
        raise ConfigError(f"{key_path} is empty; delete it and {digest_path} to make a new one")
    digest_path.write_text(f"# the digest of {key_path.name} (llmgw up's dashboard login)\n{hash_key(key)}\n",
                           encoding="ascii")
    return key_path, digest_path
