"""A JetStream object store bucket, for blobs larger than a message: the fold's snapshots.

The object store chunks a blob over messages of its own stream (``OBJ_<bucket>``:
chunks on ``$O.<bucket>.C.<nuid>``, one rolled-up meta per name on
``$O.<bucket>.M.<base64 name>``). Writes go through nats-py's object store;
reads go through the stream reader with a subject filter, the pull consumer every
role already reads with (nats-py's reads use push consumers, flow control and a
stream lookup a role's permissions would have to allow too). Each object's
description carries our own small JSON header, so choosing one means listing
metas, never reading blobs.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, NamedTuple

from llmgw.bus import deferred  # noqa: F401 - before nats: it hides aiohttp from nats-py's import

# isort: split
import nats.errors
import nats.js.errors
from nats.js.api import ObjectMeta, ObjectStoreConfig, StorageType
from nats.js.object_store import ObjectStore

from llmgw.errors import BusError
from llmgw.subjects import js_stream

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

    async def _guarded(self, op: Awaitable[Any]) -> Any:
        """A write refused by permissions (its meta lookup, or its chunks) raises at once, not a timeout."""
        stream = f"OBJ_{self.bucket}"
        return await self.bus.guarded(js_stream("MSG.GET", stream), self.bus.guarded(f"$O.{self.bucket}.>", op))

    async def _open(self) -> ObjectStore | None:
        """The bucket, or None when nobody declared it (an older fleet: nothing to read)."""
        if self._store is None:
            try:
                self._store = await self.bus.guarded(js_stream("INFO", f"OBJ_{self.bucket}"),
                                                      self.bus.js.object_store(self.bucket))
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
            await self._guarded(store.put(name, data, meta=ObjectMeta(name=name, description=description)))
        except _ERRORS as e:
            raise BusError(f"cannot write {self.bucket}/{name}: {e or type(e).__name__}") from e

    async def _read(self, subject: str) -> list[bytes]:
        """Every message on ``subject`` (a filter) in the bucket's stream, through the stream reader:
        the same ephemeral pull consumer every role already reads with, so reading needs no more rights."""
        stream = f"OBJ_{self.bucket}"
        try:
            last = await self.bus.stream_last_seq(stream)
        except BusError:
            return []  # nobody declared the bucket: no snapshots
        out: list[bytes] = []
        if last:
            async for batch in self.bus.reader(stream, 1, stop_at=last, filter_subjects=[subject],
                                                  purpose=f"reads {self.bucket} objects").batches():
                out.extend(x.data for x in batch)
        return out

    async def _metas(self, name: str = "*") -> dict[str, dict[str, Any]]:
        """The newest meta of each object (or of ``name``), deleted ones left out."""
        key = "*" if name == "*" else base64.urlsafe_b64encode(name.encode()).decode()
        metas: dict[str, dict[str, Any]] = {}
        for data in await self._read(f"$O.{self.bucket}.M.{key}"):
            try:
                meta = json.loads(data)
                metas[str(meta["name"])] = meta
            except (ValueError, KeyError, TypeError):
                continue
        return {n: meta for n, meta in metas.items() if not meta.get("deleted")}

    async def list(self) -> list[ObjectEntry]:
        """Every object not deleted (none when the bucket is empty or missing)."""
        return [ObjectEntry(n, str(meta.get("description") or ""), int(meta.get("size") or 0))
                for n, meta in sorted((await self._metas()).items())]

    async def get(self, name: str) -> bytes:
        """An object's bytes, checked against the digest its meta records."""
        meta = (await self._metas(name)).get(name)
        if meta is None:
            raise BusError(f"no object {self.bucket}/{name}")
        data = b"".join(await self._read(f"$O.{self.bucket}.C.{meta.get('nuid', '')}"))
        digest = str(meta.get("digest") or "").split("=", 1)[-1]
        if base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode() != digest:
            raise BusError(f"{self.bucket}/{name}: its chunks do not match its digest")
        return data

    async def delete(self, name: str) -> None:
        store = await self._open()
        if store is None:
            return
        try:
            await self._guarded(store.delete(name))
        except nats.js.errors.NotFoundError:
            return
        except _ERRORS as e:
            raise BusError(f"cannot delete {self.bucket}/{name}: {e or type(e).__name__}") from e
