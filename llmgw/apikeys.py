"""API keys, as the router and the dashboard check them: a file of SHA-256 digests, never the keys."""

from __future__ import annotations

import hashlib
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
