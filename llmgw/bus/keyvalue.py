"""A key-value bucket (the scheduler's lease), typed, with NATS errors translated at this edge."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from llmgw.bus import deferred  # noqa: F401 - before nats: it hides aiohttp from nats-py's import

# isort: split
import nats.errors
import nats.js.errors

from llmgw.errors import BusError

if TYPE_CHECKING:
    from nats.js.kv import KeyValue

    from llmgw.bus.connection import Bus


class KeyValueBucket:
    """One bucket: create a key, update or delete it by revision. A refusal (the key exists, a stale
    revision) and a bus that does not answer are both a BusError naming the key."""

    def __init__(self, bus: Bus, bucket: str, kv: KeyValue) -> None:
        self.bus, self.bucket, self._kv = bus, bucket, kv

    async def ttl_s(self) -> float | None:
        """How long a key lives after its last write, as the bucket was declared (None: for ever)."""
        status = await self._call("status", self._kv.status())
        return status.ttl

    async def create(self, key: str, value: bytes) -> int:
        """Write ``key`` if it does not exist; its revision."""
        return int(await self._call(f"create {key}", self._kv.create(key, value)))

    async def update(self, key: str, value: bytes, last: int) -> int:
        """Write ``key`` if its revision is still ``last``; the new revision."""
        return int(await self._call(f"update {key}", self._kv.update(key, value, last=last)))

    async def get(self, key: str) -> tuple[bytes, int] | None:
        """``key``'s value and revision; None when it has none (never written, deleted, expired)."""
        try:
            entry = await self._call(f"get {key}", self._kv.get(key))
        except BusError as e:
            if isinstance(e.__cause__, nats.js.errors.KeyNotFoundError):
                return None
            raise
        return (entry.value or b"", int(entry.revision or 0))

    async def delete(self, key: str, last: int | None = None) -> None:
        """Delete ``key`` (if its revision is still ``last``, when given)."""
        await self._call(f"delete {key}", self._kv.delete(key, last=last))

    async def _call(self, what: str, op: Awaitable[Any]) -> Any:
        try:
            return await self.bus.guarded(f"$KV.{self.bucket}.>", op)
        except BusError:
            raise
        except (nats.js.errors.Error, nats.errors.Error, TimeoutError) as e:
            raise BusError(f"key-value {self.bucket}: {what}: {e or type(e).__name__}") from e
