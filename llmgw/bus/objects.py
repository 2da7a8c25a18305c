"""A JetStream object store bucket, for blobs larger than a message: the fold's snapshots.

The object store chunks a blob over messages of its own stream (``OBJ_<bucket>``)
and keeps one meta message per name; nats-py checks the SHA-256 digest on read.
Each object's description carries our own small JSON header, so choosing one
means listing metas, never reading blobs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import nats.errors
import nats.js.errors
from nats.js.api import ObjectMeta, ObjectStoreConfig, StorageType
from nats.js.object_store import ObjectStore

from llmgw.errors import BusError

if TYPE_CHECKING:
    from llmgw.bus.connection import Bus


class ObjectEntry(NamedTuple):
    name: str
    description: str
    size: int


_ERRORS = (nats.errors.Error, nats.js.errors.Error, TimeoutError)


class ObjectBucket:
    """One bucket: create (admin), put, list, get, delete."""

    def __init__(self, bus: Bus, bucket: str) -> None:
        self.bus, self.bucket = bus, bucket
        self._store: ObjectStore | None = None

    async def ensure(self, *, replicas: int = 1, description: str = "") -> None:
        """Declare the bucket if it is missing (streams are the admin's job: ``llmgw nats`` / ``up``)."""
        try:
            self._store = await self.bus.js.object_store(self.bucket)
        except nats.js.errors.BucketNotFoundError:
            config = ObjectStoreConfig(description=description, storage=StorageType.FILE, replicas=replicas)
            self._store = await self.bus.js.create_object_store(self.bucket, config=config)

    async def _open(self) -> ObjectStore | None:
        """The bucket, or None when nobody declared it (an older fleet: nothing to read)."""
        if self._store is None:
            try:
                self._store = await self.bus.js.object_store(self.bucket)
            except nats.js.errors.BucketNotFoundError:
                return None
            except _ERRORS as e:
                raise BusError(f"cannot open the object bucket {self.bucket}: {e or type(e).__name__}") from e
        return self._store

    async def put(self, name: str, data: bytes, description: str) -> None:
        store = await self._open()
        if store is None:
            raise BusError(f"the object bucket {self.bucket} does not exist; `llmgw nats` (or `llmgw up`) declares it")
        try:
            await store.put(name, data, meta=ObjectMeta(name=name, description=description))
        except _ERRORS as e:
            raise BusError(f"cannot write {self.bucket}/{name}: {e or type(e).__name__}") from e

    async def list(self) -> list[ObjectEntry]:
        """Every object not deleted (none when the bucket is empty or missing)."""
        store = await self._open()
        if store is None:
            return []
        try:
            infos = await store.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return []
        except _ERRORS as e:
            raise BusError(f"cannot list {self.bucket}: {e or type(e).__name__}") from e
        return [ObjectEntry(i.name, i.description or "", i.size or 0) for i in infos if not i.deleted]

    async def get(self, name: str) -> bytes:
        store = await self._open()
        if store is None:
            raise BusError(f"the object bucket {self.bucket} does not exist")
        try:
            return bytes((await store.get(name)).data or b"")
        except _ERRORS as e:  # a digest mismatch is one of these too
            raise BusError(f"cannot read {self.bucket}/{name}: {e or type(e).__name__}") from e

    async def delete(self, name: str) -> None:
        store = await self._open()
        if store is None:
            return
        try:
            await store.delete(name)
        except nats.js.errors.NotFoundError:
            return
        except _ERRORS as e:
            raise BusError(f"cannot delete {self.bucket}/{name}: {e or type(e).__name__}") from e
