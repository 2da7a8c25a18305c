"""The connection: log in, publish idempotently, request/reply, serve, declare streams, key-value.

Over 600 lines: this is the one module that holds a nats-py client, so every call that
translates a driver error into ours (``guarded``) lives here; the readers, the outbox and
the buckets it hands out are their own modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import Awaitable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

from llmgw.bus import deferred  # noqa: F401 - before nats: it hides aiohttp from nats-py's import

# isort: split
import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig, StorageType, StreamConfig
from nats.js.client import JetStreamContext
from nats.protocol.parser import Parser

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus.deferred import websockets
from llmgw.bus.follow import Follower
from llmgw.bus.frames import (
    READER_BYTES_IN_FLIGHT,
    Ack,
    FrameHandler,
    FrameParser,
    Handler,
    RawHandler,
)
from llmgw.bus.keyvalue import KeyValueBucket
from llmgw.bus.objects import ObjectBucket
from llmgw.bus.oneshot import describe_connect_error, tls_context
from llmgw.bus.outbox import Outbox
from llmgw.bus.reader import StreamReader, consumer_name
from llmgw.config import Settings
from llmgw.errors import (
    BusError,
    ConnectError,
    NoServiceError,
    PermissionDeniedError,
    PublishError,
    ServiceError,
)

log = logging.getLogger(__name__)

LEASE_TTL_S = 10.0  # the scheduler's lease outlives a dead leader this long (declare-streams --lease-ttl)
T = TypeVar("T")


_RETRYABLE = (
    asyncio.TimeoutError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
)


def _tls_context(settings: Settings) -> ssl.SSLContext | None:
    return tls_context(settings)


def _describe_connect_error(settings: Settings, err: BaseException | None) -> str:
    return describe_connect_error(settings, str(err) if err else "",
                                  auth=isinstance(err, nats.errors.AuthorizationError),
                                  tls=isinstance(err, ssl.SSLError))


async def _abandon(nc: NatsClient) -> None:
    """Close what a failed connect left open; its own waiters may be cancelled (TLS), we are not."""
    task = asyncio.current_task()
    for step in ("close", "transport"):
        try:
            if step == "close":
                async with asyncio.timeout(2):
                    await nc.close()
            elif (transport := getattr(nc, "_transport", None)) is not None:
                transport.close()
                async with asyncio.timeout(1):
                    await transport.wait_closed()
        except asyncio.CancelledError:
            if task is not None and task.cancelling():
                raise
        except Exception:  # noqa: BLE001, S110 - best effort on a connection that already failed
            pass


class Bus:
    """A connection to NATS with JetStream, and the operations llmgw needs of it."""

    def __init__(self, nc: NatsClient, settings: Settings, *, fast_reads: bool = True, name: str = "llmgw") -> None:
        self.nc = nc
        self.name = name  # the connection's name: what the server's monitoring and our consumers' names show
        self.js: JetStreamContext = nc.jetstream(timeout=settings.request_timeout_s)
        self.settings = settings
        self._denied: dict[str, list[asyncio.Future[str]]] = {}
        self._closing = False
        self._raw_handlers: dict[int, RawHandler] = {}
        self._frame_handlers: dict[bytes, FrameHandler] = {}  # by the subscription id's digits
        if fast_reads:
            self._install_raw_path()

    def _install_raw_path(self) -> None:
        """Hand stream readers their messages as bytes, before nats-py builds a ``Msg``.

        nats-py parses every message's headers (each stored message carries its
        ``Nats-Msg-Id``), builds a ``Msg`` and queues it for a task: more than
        half of a replay's time on two cores, none of which a reader needs. Its
        protocol parser calls ``Client._process_msg`` for each message; that is
        wrapped here so that subscriptions registered in ``_raw_handlers`` get
        (subject, reply, data, headers) directly and all others go on as before.
        The parser itself is replaced by ``FrameParser``, whose fast lane hands
        readers in ``_frame_handlers`` whole chunks of deliveries; what it passes
        on to nats-py's parser still arrives here. If a future nats-py lacks
        these internals, readers use the ordinary path.
        """
        slow = getattr(self.nc, "_process_msg", None)
        if slow is None:
            return
        handlers = self._raw_handlers

        async def process_msg(sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
            handler = handlers.get(sid)
            if handler is None:
                await slow(sid, subject, reply, data, headers)
            else:
                handler(subject, reply, data, headers)

        self.nc._process_msg = process_msg  # type: ignore[method-assign]
        old = getattr(self.nc, "_ps", None)
        if isinstance(old, Parser) and type(old) is Parser:
            self.nc._ps = FrameParser(self.nc, self._frame_handlers, old)

    # --- connection ------------------------------------------------------------

    @classmethod
    async def connect(cls, settings: Settings, name: str, *, reconnect: bool = True, fast_reads: bool = True) -> Bus:
        """Connect, or raise ConnectError with what to do next.

        Long-running services pass ``reconnect=True`` and ride out outages;
        the CLI passes False so that a dead server is an error, not a hang.
        ``fast_reads=False`` leaves nats-py's message path as it is (stream
        readers then get ``Msg`` objects): for comparison in benchmarks.
        """
        holder: list[Bus] = []
        first_error: list[BaseException] = []

        async def error_cb(e: Exception) -> None:
            if holder:
                holder[0]._on_error(e)
            elif not first_error:
                first_error.append(e)

        async def disconnected_cb() -> None:
            if holder and not holder[0]._closing:
                log.warning("%s: disconnected from NATS; reconnecting", name)

        async def reconnected_cb() -> None:
            log.warning("%s: reconnected to NATS", name)

        opts: dict[str, Any] = dict(
            servers=[u.strip() for u in settings.nats_url.split(",")],
            name=name,
            connect_timeout=settings.connect_timeout_s,
            allow_reconnect=reconnect,
            # nats-py reads 0 as "no limit"; 1 means one try and one retry.
            max_reconnect_attempts=-1 if reconnect else 1,
            reconnect_time_wait=0.5,
            error_cb=error_cb,
            disconnected_cb=disconnected_cb,
            reconnected_cb=reconnected_cb,
            # Large enough to hold an outage's worth of small events in the client.
            pending_size=64 * 1024 * 1024,
        )
        tls = _tls_context(settings)
        if tls is not None:
            opts["tls"] = tls
        if settings.creds_file:
            opts["user_credentials"] = settings.creds_file
        if settings.nkey_seed_file:
            opts["nkeys_seed"] = settings.nkey_seed_file
        if settings.user:
            opts["user"], opts["password"] = settings.user, settings.password or ""
            # Replies come to this user's own inbox prefix, the only one nats.conf lets it read:
            # under the shared _INBOX.> any role could read (and act on) another's replies.
            opts["inbox_prefix"] = subjects.inbox_prefix(settings.user)
        if any(u.startswith(("ws://", "wss://")) for u in opts["servers"]):
            websockets()
        nc = NatsClient()
        try:
            async with asyncio.timeout(settings.connect_timeout_s * 3 + 2):
                await nc.connect(**opts)
        except (TimeoutError, OSError, nats.errors.Error, ssl.SSLError) as e:
            cause = first_error[0] if first_error else e
            # A refused login leaves nats-py's socket open; close it rather than leak it.
            await _abandon(nc)
            raise ConnectError(_describe_connect_error(settings, cause)) from e
        bus = cls(nc, settings, fast_reads=fast_reads, name=name)
        holder.append(bus)
        return bus

    @property
    def connected(self) -> bool:
        """Whether the connection to NATS is up now (a reconnect in progress is not)."""
        return bool(self.nc.is_connected)

    @property
    def closed(self) -> bool:
        """Whether ``close`` ended it (or it failed for good)."""
        return bool(self.nc.is_closed)

    @property
    def reconnects(self) -> int:
        """How often the connection came back since it was opened."""
        return int(self.nc.stats.get("reconnects", 0))

    async def close(self) -> None:
        self._closing = True
        if not self.nc.is_closed:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await self.nc.drain()
            with contextlib.suppress(Exception):
                await self.nc.close()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _on_error(self, e: Exception) -> None:
        text = str(e)
        if "permissions violation" in text.lower():
            subject = text.split('"')[1] if text.count('"') >= 2 else ""
            # nats-py lowercases the server's message, so "$JS.API…" comes back as "$js.api…".
            # A watched key ending in ">" stands for every subject under it (an object's chunks).
            low = subject.lower()
            for key in [k for k in self._denied
                        if k.lower() == low or (k.endswith(">") and low.startswith(k[:-1].lower()))]:
                for fut in self._denied.pop(key, []):
                    if not fut.done():
                        fut.set_result(text)
            log.error("NATS refused: %s", text)
        else:
            log.warning("NATS: %s", text)

    def _watch_denied(self, subject: str) -> asyncio.Future[str]:
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._denied.setdefault(subject, []).append(fut)
        return fut

    def _unwatch(self, subject: str, fut: asyncio.Future[str]) -> None:
        waiters = self._denied.get(subject)
        if waiters and fut in waiters:
            waiters.remove(fut)
            if not waiters:
                del self._denied[subject]

    async def guarded(self, subject: str, op: Awaitable[Any]) -> Any:
        """Run a request to ``subject``; a permission violation raises at once, not a timeout."""
        denied = self._watch_denied(subject)
        task = asyncio.ensure_future(op)
        try:
            done, _ = await asyncio.wait({task, denied}, return_when=asyncio.FIRST_COMPLETED)
            if denied in done:
                task.cancel()
                raise PermissionDeniedError(
                    f"NATS refused {subject!r} for these credentials ({denied.result()}); "
                    "check the user's permissions in nats.conf"
                )
            return task.result()
        finally:
            self._unwatch(subject, denied)
            if not task.done():
                task.cancel()

    # --- streams -----------------------------------------------------------------

    async def ensure_streams(self, replicas: int | None = None, lease_ttl_s: float = LEASE_TTL_S, *,
                             lease: bool = True) -> None:
        """Declare llmgw's streams, the fold snapshots' object bucket and (``lease``) the scheduler's
        lease bucket (``lease_ttl_s``: how long a dead leader's lease outlives it); re-declaring changes
        nothing. A role that only checks them at its start leaves out what it may not even see.

        Every one of them is declared here, by admin, with a fixed configuration: a role that could
        create a bucket before it exists could give it any subjects (``_INBOX.>`` stores every reply).
        """
        replicas = replicas or self.settings.stream_replicas
        for spec in subjects.STREAMS:
            config = StreamConfig(
                name=spec.name,
                subjects=list(spec.subjects),
                storage=StorageType.FILE,
                num_replicas=replicas,
                max_age=spec.max_age_s,
                max_bytes=spec.max_bytes,
                duplicate_window=spec.duplicate_window_s,
                max_msgs_per_subject=spec.max_msgs_per_subject,
                discard="new" if spec.discard_new else "old",  # type: ignore[arg-type]
                allow_direct=True,
            )
            try:
                try:
                    info = await self.js.stream_info(spec.name)
                except nats.js.errors.NotFoundError:
                    await self.guarded(subjects.js_stream("CREATE", spec.name), self.js.add_stream(config))
                    continue
                current = info.config
                if (
                    list(current.subjects or []) != list(spec.subjects)
                    or current.max_age != config.max_age
                    or current.max_bytes != config.max_bytes
                    or current.duplicate_window != config.duplicate_window
                    or current.max_msgs_per_subject != config.max_msgs_per_subject
                ):
                    # Replicas are left as the operator set them on a running cluster.
                    config.num_replicas = current.num_replicas
                    await self.guarded(subjects.js_stream("UPDATE", spec.name), self.js.update_stream(config))
            except PermissionDeniedError as e:
                raise PermissionDeniedError(
                    f"stream {spec.name} is missing or differs from what this llmgw declares, and user "
                    f"{self.settings.user or '(none)'} may not create or update streams (only admin may); "
                    "run `llmgw declare-streams` as admin (LLMGW_NATS_USER=admin) first"
                ) from e
            except nats.js.errors.APIError as e:
                raise BusError(f"cannot declare stream {spec.name}: {e.description} (code {e.err_code})") from e
            except _RETRYABLE as e:
                raise BusError(
                    f"JetStream did not answer while declaring {spec.name}; is JetStream enabled on "
                    f"{self.settings.nats_url} (nats-server -js), and does the cluster have quorum?"
                ) from e
        try:
            await self.objects(subjects.SNAPSHOT_BUCKET).ensure(
                replicas=replicas, description="the projector's fold snapshots (llmgw.fleet.snapshots)")
        except (nats.js.errors.APIError, *_RETRYABLE) as e:
            raise BusError(f"cannot declare the object bucket {subjects.SNAPSHOT_BUCKET}: {e}") from e
        if lease:
            await self.key_value(subjects.SCHEDULER_LEASE_BUCKET, lease_ttl_s, replicas=replicas)

    async def stream_last_seq(self, stream: str) -> int:
        """The last sequence stored in a stream (0 when empty)."""
        return (await self.stream_head(stream))[0]

    async def stream_head(self, stream: str) -> tuple[int, str]:
        """A stream's last sequence (0 when empty) and when JetStream created it (ISO 8601).

        The creation time tells one incarnation of a stream from another: a
        stream deleted and declared again restarts at sequence 1 under the same name.
        Guarded like every request here, which also keeps a cancel from being lost:
        Python 3.11's ``asyncio.wait_for`` in nats-py returns a reply that arrives
        with a cancel and drops the cancel, and a reader cancelled at its start
        would then follow its stream forever.
        """
        try:
            info = await self.guarded(subjects.js_stream("INFO", stream), self.js.stream_info(stream))
        except nats.js.errors.NotFoundError as e:
            raise BusError(f"stream {stream} does not exist; start the control plane once (`llmgw up`) to declare it") from e
        except _RETRYABLE as e:
            raise BusError(f"JetStream did not answer for stream {stream}") from e
        created = info.created.isoformat() if isinstance(info.created, datetime) else str(info.created or "")
        return int(info.state.last_seq), created

    async def _consumer_once(self, stream: str, what: str, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """A consumer made for one question about ``stream`` (``what``): its name and JetStream's answer to
        its creation. Unacknowledged, in memory, gone after 5 s idle; the caller deletes it (``_drop``)."""
        name = consumer_name(self.name, stream)
        config = {**config, "name": name, "ack_policy": "none", "mem_storage": True, "num_replicas": 1,
                  "inactive_threshold": int(5e9), "description": f"{self.name}: {what}"}
        subject = subjects.js_consumer("CREATE", stream, name)
        if "filter_subject" in config:  # as nats.conf grants it: CREATE.<stream>.<name>.<filter>
            subject += "." + config["filter_subject"]
        body = json.dumps({"stream_name": stream, "config": config, "action": "create"}).encode()
        try:
            msg = await self.guarded(subject, self.nc.request(subject, body, timeout=self.settings.request_timeout_s))
        except _RETRYABLE as e:
            raise BusError(f"JetStream did not answer for {what}") from e
        resp = json.loads(msg.data)
        if resp.get("error"):
            err = resp["error"]
            raise BusError(f"cannot read {what}: {err.get('description')} (code {err.get('err_code')})")
        return name, resp

    async def _drop(self, stream: str, consumer: str) -> None:
        with contextlib.suppress(*_RETRYABLE):
            await self.nc.request(subjects.js_consumer("DELETE", stream, consumer), b"", timeout=1)

    async def seq_at_time(self, stream: str, when: datetime) -> int:
        """The first sequence ``stream`` stored at or after ``when`` (its last + 1 when none is).

        JetStream finds it by the stored messages' times, on the server: a consumer created to start there
        (``by_start_time``) says where, before it delivers anything, and is deleted at once. Any
        role that reads the stream may ask (nats.conf's consumer grants).
        """
        at = when.astimezone(UTC).isoformat()
        name, resp = await self._consumer_once(stream, f"where {stream} stands at {at}",
                                               {"deliver_policy": "by_start_time", "opt_start_time": at})
        await self._drop(stream, name)
        return int(resp["delivered"]["stream_seq"]) + 1

    async def last_per_subject(self, stream: str, subjects_: str) -> list[tuple[int, str, bytes]]:
        """The latest message of every subject ``subjects_`` (a wildcard) matches: (sequence, subject, payload).

        One consumer that delivers the last message per subject (``last_per_subject``), pulled once
        with ``no_wait`` and deleted: what a router starting reads of every router's day totals.
        """
        what = f"the last {subjects_} of {stream}"
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        name = ""
        try:
            name, resp = await self._consumer_once(stream, what, {"deliver_policy": "last_per_subject",
                                                                  "filter_subject": subjects_})
            out: list[tuple[int, str, bytes]] = []
            left = int(resp.get("num_pending", 0))
            if left:
                await self.nc.publish(subjects.js_consumer("MSG.NEXT", stream, name),
                                      json.dumps({"batch": left, "no_wait": True}).encode(), reply=inbox)
            while len(out) < left:
                try:
                    got = await sub.next_msg(timeout=self.settings.request_timeout_s)
                except nats.errors.TimeoutError as e:
                    raise BusError(f"JetStream stopped sending {what} ({len(out)} of {left})") from e
                if not got.reply:  # a status (404: no more, 408: expired): what was there has come
                    break
                out.append((int(got.metadata.sequence.stream), got.subject, got.data))
            return out
        finally:
            await sub.unsubscribe()
            if name:
                await self._drop(stream, name)

    async def purge_subject(self, stream: str, subject: str) -> None:
        """Drop every message of ``subject`` from ``stream`` (admin's: only admin may purge)."""
        try:
            await self.guarded(subjects.js_stream("PURGE", stream), self.js.purge_stream(stream, subject=subject))
        except nats.js.errors.APIError as e:
            raise BusError(f"cannot purge {subject} from {stream}: {e.description} (code {e.err_code})") from e
        except _RETRYABLE as e:
            raise BusError(f"JetStream did not answer the purge of {subject} from {stream}") from e

    async def last_stored_seq(self, stream: str, subject: str) -> int:
        """Where ``stream`` holds the latest message of ``subject`` (a direct get by subject); 0: none."""
        got = await self.last_message(stream, subject)
        return 0 if got is None else got[0]

    async def last_message(self, stream: str, subject: str) -> tuple[int, bytes] | None:
        """The latest message of ``subject`` in ``stream`` (a direct get by subject): (sequence, payload), or None."""
        try:
            raw = await self.guarded(subjects.js_api("DIRECT.GET", stream, subject),
                                     self.js.get_msg(stream, subject=subject, direct=True))
        except nats.js.errors.NotFoundError:
            return None
        except nats.js.errors.APIError as e:
            raise BusError(f"cannot read the last {subject} of {stream}: {e.description} (code {e.err_code})") from e
        except _RETRYABLE as e:
            raise BusError(f"JetStream did not answer for the last {subject} of {stream}") from e
        return int(raw.seq or 0), raw.data or b""

    async def stored_message(self, stream: str, seq: int) -> tuple[str, bytes]:
        """The subject and payload ``stream`` stores at ``seq`` (a direct get); BusError when it holds none."""
        try:
            raw = await self.guarded(subjects.js_api("DIRECT.GET", stream),
                                      self.js.get_msg(stream, seq, direct=True))
        except nats.js.errors.NotFoundError as e:
            raise BusError(f"{stream} holds no message at sequence {seq}") from e
        except nats.js.errors.APIError as e:
            raise BusError(f"cannot read {stream}:{seq}: {e.description} (code {e.err_code})") from e
        except _RETRYABLE as e:
            raise BusError(f"JetStream did not answer for {stream}:{seq}") from e
        return raw.subject or "", raw.data or b""

    async def key_value(self, bucket: str, ttl_s: float, replicas: int | None = None) -> KeyValueBucket:
        """A KV bucket (the scheduler's lease), created with ``ttl_s`` if missing and this user may
        (admin; anyone on an open bus); an existing one is used as it was declared."""
        stream = f"KV_{bucket}"
        try:
            try:
                kv = await self.guarded(subjects.js_stream("INFO", stream), self.js.key_value(bucket))
            except nats.js.errors.BucketNotFoundError:
                config = KeyValueConfig(bucket=bucket, history=1, ttl=ttl_s,
                                        replicas=replicas or self.settings.stream_replicas)
                kv = await self.guarded(subjects.js_stream("CREATE", stream), self.js.create_key_value(config))
            return KeyValueBucket(self, bucket, kv)
        except PermissionDeniedError as e:
            raise PermissionDeniedError(
                f"the key-value bucket {bucket} is missing, and user {self.settings.user or '(none)'} may not "
                "create it (only admin may); run `llmgw declare-streams` as admin (LLMGW_NATS_USER=admin) first"
            ) from e
        except nats.js.errors.APIError as e:
            raise BusError(f"cannot declare the key-value bucket {bucket}: {e.description} (code {e.err_code})") from e
        except _RETRYABLE as e:
            raise BusError(f"JetStream did not answer for the key-value bucket {bucket}") from e

    # --- publish -----------------------------------------------------------------------

    async def publish(self, event: m.Event, *, msg_id: str | None = None, timeout: float | None = 30.0) -> Ack:  # noqa: ASYNC109 - public API; None means forever
        """Store an event once; retry with the same id until acked or ``timeout`` (None: forever)."""
        payload = m.encode(event)
        subject = subjects.subject_for(event)
        return await self.publish_bytes(subject, payload, msg_id or subjects.msg_id(event, payload), timeout=timeout)

    async def publish_bytes(self, subject: str, payload: bytes, msg_id: str, *, timeout: float | None = 30.0) -> Ack:  # noqa: ASYNC109 - public API; None means forever
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        delay = 0.05
        attempt_timeout = min(self.settings.request_timeout_s, 2.0)
        while True:
            if self.nc.is_closed:
                raise PublishError(f"the NATS connection is closed; {subject} was not published")
            try:
                ack = await self.guarded(
                    subject,
                    self.js.publish(subject, payload, timeout=attempt_timeout, headers={"Nats-Msg-Id": msg_id}),
                )
                return Ack(ack.stream, ack.seq, bool(ack.duplicate))
            except PermissionDeniedError:
                raise
            except nats.js.errors.APIError as e:
                # 503: no quorum / JetStream unavailable for a moment; 10158: an earlier try with
                # this id is still being replicated (it ends stored or not, then we learn which);
                # everything else is final.
                if e.code != 503 and e.err_code != 10158:
                    raise PublishError(f"JetStream refused {subject}: {e.description} (code {e.err_code})") from e
            except _RETRYABLE:
                pass
            except nats.errors.ConnectionClosedError as e:
                raise PublishError(f"the NATS connection closed; {subject} was not published") from e
            if deadline is not None and loop.time() + delay > deadline:
                raise PublishError(
                    f"no acknowledgement for {subject} after {timeout:.0f}s; the server or its stream "
                    "leader is down (the event may be stored; retrying with the same id is safe)"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def publish_many(self, events: Sequence[m.Event], *, window: int = 2048) -> list[Ack]:
        """Store many events fast: pipelined, each with its own id, stragglers retried.

        Order on the stream follows ``events`` unless a publish must be retried
        (an outage mid-batch); use ``publish``/``Outbox`` where order matters.
        """
        acks: list[Ack] = []
        for start in range(0, len(events), window):
            chunk = events[start : start + window]
            items = []
            for e in chunk:
                payload = m.encode(e)
                items.append((subjects.subject_for(e), payload, subjects.msg_id(e, payload)))
            futures = [
                await self.js.publish_async(subj, payload, headers={"Nats-Msg-Id": mid})
                for subj, payload, mid in items
            ]
            results = await asyncio.gather(*futures, return_exceptions=True)
            for (subj, payload, mid), res in zip(items, results, strict=True):
                if isinstance(res, BaseException):
                    acks.append(await self.publish_bytes(subj, payload, mid))
                else:
                    acks.append(Ack(res.stream, res.seq, bool(res.duplicate)))
        return acks

    async def publish_core(self, subject: str, payload: bytes) -> None:
        """Fire-and-forget (heartbeats): the stream keeps only the latest per node."""
        try:
            await self.nc.publish(subject, payload)
        except (nats.errors.ConnectionReconnectingError, nats.errors.OutboundBufferLimitError):
            pass
        except nats.errors.ConnectionClosedError as e:
            raise PublishError("the NATS connection is closed") from e

    # --- request/reply -------------------------------------------------------------------

    async def request(self, subject: str, payload: bytes, *, timeout: float | None = None, service: str = "") -> bytes:  # noqa: ASYNC109 - public API
        """Ask a service; no responder or no answer in time is a ServiceError naming it."""
        timeout = timeout or self.settings.request_timeout_s
        who = service or subject
        try:
            msg = await self.guarded(subject, self.nc.request(subject, payload, timeout=timeout))
        except nats.errors.NoRespondersError as e:
            raise NoServiceError(f"no {who} is running on {self.settings.nats_url}; start one (`llmgw up` starts them all)") from e
        except (TimeoutError, nats.errors.TimeoutError) as e:
            raise ServiceError(f"the {who} did not answer within {timeout:.0f}s") from e
        except nats.errors.ConnectionClosedError as e:
            raise ServiceError(f"the NATS connection closed while asking the {who}") from e
        data: bytes = msg.data
        if data.startswith(b'{"type":"error"'):
            try:
                err = m.ERROR_DECODER.decode(data)
            except msgspec.DecodeError:
                pass
            else:
                raise ServiceError(f"the {who} refused the request: {err.error}")
        return data

    async def serve(self, subject: str, handler: Handler, *, queue: str = "", concurrency: int = 32) -> Any:
        """Answer requests on a subject; a handler that raises gets an error reply, never a dead service.

        Up to ``concurrency`` requests are answered at once, each in its own task:
        nats-py runs a subscription's callbacks one after another, so one slow
        request (a Hub lookup) would otherwise hold every request behind it.
        """
        slots = asyncio.Semaphore(concurrency)
        running: set[asyncio.Task[None]] = set()

        async def answer(msg: Msg) -> None:
            try:
                try:
                    reply = await handler(msg.data)
                except Exception as e:  # noqa: BLE001 - a bad request must not kill the service
                    log.warning("%s: request failed: %s", subject, e)
                    reply = m.encode(m.ErrorReply(error=str(e) or type(e).__name__))
                if msg.reply:
                    with contextlib.suppress(nats.errors.Error):
                        await msg.respond(reply)
            finally:
                slots.release()

        async def on_msg(msg: Msg) -> None:
            await slots.acquire()  # past the bound, the subscription waits: nats-py buffers, bounded
            task = asyncio.create_task(answer(msg))
            running.add(task)
            task.add_done_callback(running.discard)

        sub = await self.nc.subscribe(subject, queue=queue, cb=on_msg)
        # Once serve() returns the server knows the subscription: a service that then says
        # it is ready is reachable, not "no responders" for one round trip.
        with contextlib.suppress(nats.errors.Error, TimeoutError):  # disconnected: sent on reconnect
            await self.nc.flush(timeout=max(1, round(self.settings.request_timeout_s)))
        return sub

    # --- read ------------------------------------------------------------------------------

    def reader(
        self,
        stream: str,
        start_seq: int = 1,
        *,
        batch: int = 4096,
        stop_at: int | None = None,
        filter_subjects: Sequence[str] = (),
        idle_expires_s: float = 2.0,
        max_bytes_in_flight: int = READER_BYTES_IN_FLIGHT,
        purpose: str = "",
        say_drained: bool = False,
    ) -> StreamReader:
        """A reader of ``stream``; ``purpose`` goes into its consumer's description."""
        return StreamReader(self, stream, start_seq, batch=batch, stop_at=stop_at,
                            filter_subjects=filter_subjects, idle_expires_s=idle_expires_s,
                            max_bytes_in_flight=max_bytes_in_flight, purpose=purpose, say_drained=say_drained)

    def outbox(self, maxlen: int = 10_000, *, refusal_is_fatal: bool = False) -> Outbox:
        return Outbox(self, maxlen, refusal_is_fatal=refusal_is_fatal)

    def follow(self, stream: str, decoder: msgspec.json.Decoder[T], start: int = 1, **kw: Any) -> Follower[T]:
        """Read ``stream`` decoded, bad messages logged, counted and skipped (see ``Follower``)."""
        return Follower(self, stream, decoder, start, **kw)

    def objects(self, bucket: str) -> ObjectBucket:
        """An object store bucket (see ``ObjectBucket``)."""
        return ObjectBucket(self, bucket)
