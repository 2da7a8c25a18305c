"""The bus: the only module that imports ``nats``.

* ``Bus.connect`` logs in with URL, credentials and TLS from ``Settings``.
* ``Bus.publish`` stores an event with a deterministic ``Nats-Msg-Id`` and
  retries with the same id until acked: a publish that timed out may still have
  been stored, and the server drops the retry as a duplicate.
* ``Outbox`` queues events (bounded) and delivers them in order, exactly once,
  across server outages.
* ``StreamReader`` reads a stream from a sequence in large batches with a
  client-driven pull loop on ``$JS.API.CONSUMER.MSG.NEXT`` (nats-py's
  ``fetch()`` costs a round trip and a Future per batch and tops out near
  30k msgs/s here; this reaches several times that). Its deliveries skip
  nats-py's per-message work: ``_FrameParser`` cuts them out of the socket's
  bytes in one pass and hands each reader a chunk's worth at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, AnyStr, NamedTuple

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import ProtocolError
from nats.js.api import KeyValueConfig, StorageType, StreamConfig
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue
from nats.protocol.parser import AWAITING_CONTROL_LINE, Parser

from llmgw import messages as m
from llmgw import subjects
from llmgw.config import Settings
from llmgw.errors import (
    BusError,
    ConnectError,
    NoServiceError,
    OutboxFullError,
    PermissionDeniedError,
    PublishError,
    ServiceError,
)

log = logging.getLogger(__name__)

# What one reader may have asked nats-server for and not yet received: 3 readers on
# a connection stay far below the server's 64 MB slow-consumer limit (max_pending).
READER_BYTES_IN_FLIGHT = 8 << 20
# Per delivered message beyond its payload: the HMSG line with subject and $JS.ACK
# reply, and the Nats-Msg-Id header.
_FRAME_OVERHEAD = 256


Handler = Callable[[bytes], Awaitable[bytes]]
RawHandler = Callable[[bytes, bytes, bytes, "bytes | None"], None]
# A JetStream delivery as the parser cuts it out: (its reply subject split at the dots,
# subject, data). The reply is $JS.ACK.[<domain>.<account>.]<stream>.<consumer>.<delivered>.
# <stream seq>.<delivery seq>.<stored ns>.<pending>[.<token>].
Frame = tuple[list[bytes], bytes, bytes]
FrameHandler = Callable[[list[Frame]], None]


class Ack(NamedTuple):
    stream: str
    seq: int
    duplicate: bool


class RawMsg(NamedTuple):
    """One stored message as the reader hands it out; decoded where it is used."""

    seq: int
    subject: str
    data: bytes
    ts_ns: int


def _ack_fields(t: Sequence[AnyStr]) -> tuple[AnyStr, AnyStr, AnyStr, AnyStr, AnyStr] | None:
    """(consumer, stream seq, delivery seq, stored ns, pending) of a JetStream reply split at the dots.

    $JS.ACK.<stream>.<consumer>.<dlv>.<sseq>.<dseq>.<ts>.<pending>, or with
    <domain>.<account> after ACK and a token at the end (12 parts).
    """
    if len(t) >= 12:
        return t[5], t[7], t[8], t[9], t[10]
    if len(t) >= 9:
        return t[3], t[5], t[6], t[7], t[8]
    return None


class _FrameParser(Parser):
    """nats-py's protocol parser with one fast lane: deliveries to stream readers.

    A replay is hundreds of thousands of JetStream deliveries in a row. For
    each, nats-py tries its regular expressions in turn, copies the payload
    twice, awaits a coroutine, and (without the fast lane) parses the headers
    into a dict and queues a ``Msg``. Here the control line is split once, the
    payload sliced once, and a chunk's deliveries go to their reader as one
    list. Every other operation (PING, +OK, API replies, status messages, any
    message for an ordinary subscription) is cut out whole and handed to
    nats-py's own parser, so the connection behaves as before.
    """

    def __init__(self, nc: NatsClient, frames: dict[bytes, FrameHandler], old: Parser) -> None:
        super().__init__(nc)
        self.frames = frames
        # Whatever the old parser held (normally nothing: this runs right after CONNECT).
        self.buf, self.state, self.needed = old.buf, old.state, old.needed
        self.header_needed, self.msg_arg = old.header_needed, old.msg_arg

    async def parse(self, data: bytes = b"") -> None:
        if self.state != AWAITING_CONTROL_LINE or not self.frames:
            await super().parse(data)
            return
        buf = bytes(self.buf) + data if self.buf else data
        self.buf = bytearray()
        pos, n = 0, len(buf)
        find, frames = buf.find, self.frames
        got: dict[bytes, list[Frame]] = {}
        try:
            while pos < n:
                eol = find(b"\r\n", pos)
                if eol < 0:
                    break
                parts = buf[pos:eol].split(b" ")
                # HMSG <subject> <sid> <reply> <header bytes> <total bytes>
                if len(parts) == 6 and parts[2] in frames and parts[3].startswith(b"$JS.ACK.") and parts[0] == b"HMSG":
                    start = eol + 2
                    end = start + int(parts[5])
                    if end + 2 > n:
                        break  # the payload is still on its way
                    got.setdefault(parts[2], []).append((parts[3].split(b"."), parts[1], buf[start + int(parts[4]):end]))
                    pos = end + 2
                    continue
                # Anything else: cut out this one operation and let nats-py have it.
                end = eol + 2
                if parts[0] in (b"MSG", b"HMSG"):
                    end += int(parts[-1]) + 2
                    if end > n:
                        break
                self._deliver(got)  # what came before it, first
                got = {}
                await super().parse(buf[pos:end])
                pos = end
        except ValueError as e:  # a size that is not a number: as nats-py, a protocol error (it reconnects)
            raise ProtocolError("nats: malformed MSG") from e
        self._deliver(got)
        if pos < n:
            self.buf = bytearray(buf[pos:])

    def _deliver(self, got: dict[bytes, list[Frame]]) -> None:
        for sid, batch in got.items():
            handler = self.frames.get(sid)
            if handler is None:
                continue  # the reader stopped in between
            try:
                handler(batch)
            except Exception:  # a bug in a reader must not end the connection's read loop
                log.exception("a stream reader failed on %d deliveries; it will see the gap and re-read", len(batch))


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
    if not settings.uses_tls:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=settings.tls_ca)
    if settings.tls_cert and settings.tls_key:
        ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
    return ctx


def _describe_connect_error(settings: Settings, err: BaseException | None) -> str:
    text = str(err) if err else ""
    url = settings.nats_url
    if isinstance(err, nats.errors.AuthorizationError) or "authorization" in text.lower():
        return f"NATS at {url} refused the credentials; check --nats-creds/--nats-user (LLMGW_NATS_CREDS, LLMGW_NATS_USER)"
    if isinstance(err, ssl.SSLError) or "ssl" in text.lower() or "certificate" in text.lower():
        return f"TLS to NATS at {url} failed ({text}); check --tls-ca/--tls-cert/--tls-key"
    return f"cannot reach NATS at {url}; start one with `llmgw nats` or `llmgw up`, or point --nats-url (LLMGW_NATS_URL) at a running server"


async def _abandon(nc: NatsClient) -> None:
    """Close what a failed connect left open; its own waiters may be cancelled (TLS), we are not."""
    task = asyncio.current_task()
    for step in ("close", "transport"):
        try:
            if step == "close":
                await asyncio.wait_for(nc.close(), timeout=2)
            elif (transport := getattr(nc, "_transport", None)) is not None:
                transport.close()
                await asyncio.wait_for(transport.wait_closed(), timeout=1)
        except asyncio.CancelledError:
            if task is not None and task.cancelling():
                raise
        except Exception:  # noqa: BLE001, S110 - best effort on a connection that already failed
            pass


class Bus:
    """A connection to NATS with JetStream, and the operations llmgw needs of it."""

    def __init__(self, nc: NatsClient, settings: Settings, *, fast_reads: bool = True) -> None:
        self.nc = nc
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
        The parser itself is replaced by ``_FrameParser``, whose fast lane hands
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
            self.nc._ps = _FrameParser(self.nc, self._frame_handlers, old)

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
        nc = NatsClient()
        try:
            await asyncio.wait_for(nc.connect(**opts), timeout=settings.connect_timeout_s * 3 + 2)
        except (TimeoutError, OSError, nats.errors.Error, ssl.SSLError) as e:
            cause = first_error[0] if first_error else e
            # A refused login leaves nats-py's socket open; close it rather than leak it.
            await _abandon(nc)
            raise ConnectError(_describe_connect_error(settings, cause)) from e
        bus = cls(nc, settings, fast_reads=fast_reads)
        holder.append(bus)
        return bus

    async def close(self) -> None:
        self._closing = True
        if not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.drain(), timeout=5)
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
            for key in [k for k in self._denied if k.lower() == subject.lower()]:
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

    async def _guarded(self, subject: str, op: Awaitable[Any]) -> Any:
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

    async def ensure_streams(self, replicas: int | None = None) -> None:
        """Declare llmgw's streams; re-declaring an unchanged stream changes nothing."""
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
                    await self._guarded(f"$JS.API.STREAM.CREATE.{spec.name}", self.js.add_stream(config))
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
                    await self._guarded(f"$JS.API.STREAM.UPDATE.{spec.name}", self.js.update_stream(config))
            except nats.js.errors.APIError as e:
                raise BusError(f"cannot declare stream {spec.name}: {e.description} (code {e.err_code})") from e
            except _RETRYABLE as e:
                raise BusError(
                    f"JetStream did not answer while declaring {spec.name}; is JetStream enabled on "
                    f"{self.settings.nats_url} (nats-server -js), and does the cluster have quorum?"
                ) from e

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
            info = await self._guarded(f"$JS.API.STREAM.INFO.{stream}", self.js.stream_info(stream))
        except nats.js.errors.NotFoundError as e:
            raise BusError(f"stream {stream} does not exist; start the control plane once (`llmgw up`) to declare it") from e
        except _RETRYABLE as e:
            raise BusError(f"JetStream did not answer for stream {stream}") from e
        created = info.created.isoformat() if isinstance(info.created, datetime) else str(info.created or "")
        return int(info.state.last_seq), created

    async def key_value(self, bucket: str, ttl_s: float) -> KeyValue:
        """A KV bucket, created if missing (the scheduler's lease)."""
        try:
            return await self.js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            return await self.js.create_key_value(
                KeyValueConfig(bucket=bucket, history=1, ttl=ttl_s, replicas=self.settings.stream_replicas)
            )

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
                ack = await self._guarded(
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
            msg = await self._guarded(subject, self.nc.request(subject, payload, timeout=timeout))
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
    ) -> StreamReader:
        return StreamReader(self, stream, start_seq, batch=batch, stop_at=stop_at,
                            filter_subjects=filter_subjects, idle_expires_s=idle_expires_s,
                            max_bytes_in_flight=max_bytes_in_flight)

    def outbox(self, maxlen: int = 10_000) -> Outbox:
        return Outbox(self, maxlen)


class StreamReader:
    """Read a stream in order from a sequence, in batches, following or up to ``stop_at``.

    An ephemeral, unacknowledged consumer starts at ``start_seq``; the caller's
    checkpoint (not the server) is the durable cursor, so a resumed reader
    starts exactly after what was committed. Gaps in the consumer's delivery
    sequence, a deleted consumer, or silence all recreate it after the last
    sequence handed out.
    """

    def __init__(
        self,
        bus: Bus,
        stream: str,
        start_seq: int,
        *,
        batch: int,
        stop_at: int | None,
        filter_subjects: Sequence[str],
        idle_expires_s: float,
        max_bytes_in_flight: int = READER_BYTES_IN_FLIGHT,
    ) -> None:
        self.bus = bus
        self.stream = stream
        self.next_seq = max(1, start_seq)
        self.batch = batch
        self.max_bytes_in_flight = max_bytes_in_flight
        self._msg_bytes = 0  # unknown until the first messages arrive
        self._wake_at = batch
        self.stop_at = stop_at
        self.filter_subjects = list(filter_subjects)
        self.expires_ns = int(idle_expires_s * 1e9)
        self._idle_s = idle_expires_s
        self._buf: list[RawMsg] = []
        self._wake = asyncio.Event()
        self._credit = 0
        self._expected_dseq = 1
        self._reset = False
        # Nothing more matches right now: with a filter, ``stop_at`` may never be reached.
        self._drained = False
        self._consumer = ""
        self._inbox = ""
        self._sub: Any = None
        self.resets = 0

    async def _create_consumer(self) -> None:
        config: dict[str, Any] = {
            "deliver_policy": "by_start_sequence",
            "opt_start_seq": self.next_seq,
            "ack_policy": "none",
            "replay_policy": "instant",
            "inactive_threshold": int(30e9),
            "mem_storage": True,
            "num_replicas": 1,
            "max_waiting": 16,
        }
        if len(self.filter_subjects) == 1:
            config["filter_subject"] = self.filter_subjects[0]
        elif self.filter_subjects:
            config["filter_subjects"] = self.filter_subjects
        req = json.dumps({"stream_name": self.stream, "config": config}).encode()
        subject = f"$JS.API.CONSUMER.CREATE.{self.stream}"
        loop = asyncio.get_running_loop()
        # A cluster electing leaders, or a server coming back, answers "temporarily
        # unavailable" or not at all for a few seconds; a reader rides that out.
        deadline = loop.time() + self.bus.settings.request_timeout_s * 6
        delay = 0.1
        while True:
            problem = ""
            try:
                msg = await self.bus._guarded(subject, self.bus.nc.request(subject, req, timeout=self.bus.settings.request_timeout_s))
            except nats.errors.NoRespondersError as e:
                raise BusError(f"JetStream is not available on {self.bus.settings.nats_url}") from e
            except (TimeoutError, nats.errors.TimeoutError, nats.errors.ConnectionReconnectingError,
                    nats.errors.StaleConnectionError):
                problem = "no answer"
            else:
                resp = json.loads(msg.data)
                err = resp.get("error")
                if not err:
                    break
                problem = f"{err.get('description')} (code {err.get('err_code')})"
                if err.get("code") != 503 and err.get("err_code") != 10008:
                    raise BusError(f"cannot read stream {self.stream}: {problem}")
            if loop.time() + delay > deadline:
                raise BusError(f"cannot read stream {self.stream}: {problem} for "
                               f"{self.bus.settings.request_timeout_s * 6:.0f}s; does the cluster have quorum?")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
        self._consumer = resp["name"]
        self._credit = 0
        self._expected_dseq = 1
        self._reset = False
        self._drained = int(resp.get("num_pending", 1)) == 0

    async def _delete_consumer(self) -> None:
        if self._consumer and not self.bus.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.bus.nc.request(
                    f"$JS.API.CONSUMER.DELETE.{self.stream}.{self._consumer}", b"", timeout=1
                )
        self._consumer = ""

    def _on_raw(self, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        """One message for this reader, as the protocol parser saw it (the fast path)."""
        if reply.startswith(b"$JS.ACK."):
            self._on_frames([(reply.split(b"."), subject, data)])
            return
        # A status message: "NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 8\r\n…"
        lines = (headers or b"").decode(errors="replace").split("\r\n")
        parts = lines[0].split(" ", 2)
        status = parts[1] if len(parts) > 1 else ""
        fields = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
        left = fields.get("Nats-Pending-Messages")
        self._status(status, parts[2] if len(parts) > 2 else "", left.strip() if left else None)

    def _on_frames(self, frames: list[Frame]) -> None:
        """A chunk's worth of messages for this reader, from the parser's fast lane."""
        first, last = frames[0][0], frames[-1][0]
        k = 0 if len(first) == 9 else 2  # the reply without or with <domain>.<account>
        consumer = self._consumer.encode()
        if (not self._reset and len(first) == len(last) and len(first) in (9, 12)
                and first[3 + k] == consumer and last[3 + k] == consumer
                and int(first[6 + k]) == self._expected_dseq
                and int(last[6 + k]) == self._expected_dseq + len(frames) - 1):
            # The common case: all in order from the current consumer. Delivery
            # sequences only grow, so first and last in place means none is missing.
            self._credit -= len(frames)
            self._expected_dseq += len(frames)
            self._sized(max(len(frames[0][2]), len(frames[-1][2])))
            new = tuple.__new__
            self._buf.extend([new(RawMsg, (int(t[5 + k]), s.decode(), d, int(t[7 + k]))) for t, s, d in frames])
            self._drained = last[8 + k] == b"0"
            if len(self._buf) >= self._wake_at or self._drained:
                self._wake.set()
            return
        for t, subject, data in frames:
            fields = _ack_fields(t)
            if fields is None:
                continue  # not a delivery this reader can place
            consumer, sseq, dseq, ts, pending = fields
            self._stored(consumer.decode(), int(sseq), int(dseq), int(ts), pending == b"0", subject.decode(), data)

    async def _on_msg(self, msg: Msg) -> None:
        """The same through nats-py's ordinary path, when the fast one is not installed."""
        reply = msg.reply
        if reply.startswith("$JS.ACK."):
            fields = _ack_fields(reply.split("."))
            if fields is not None:
                consumer, sseq, dseq, ts, pending = fields
                self._stored(consumer, int(sseq), int(dseq), int(ts), pending == "0", msg.subject, msg.data)
            return
        headers = msg.headers or {}
        self._status(headers.get("Status") or "", headers.get("Description") or "", headers.get("Nats-Pending-Messages"))

    def _stored(self, consumer: str, sseq: int, dseq: int, ts: int, last: bool, subject: str, data: bytes) -> None:
        if consumer != self._consumer:
            return  # still in flight from a consumer we replaced
        self._credit -= 1
        if self._reset:
            return
        if dseq != self._expected_dseq:
            self._reset = True  # a gap: recreate from the last sequence handed out
        else:
            self._expected_dseq += 1
            self._sized(len(data))
            self._buf.append(RawMsg(sseq, subject, data, ts))
            self._drained = last
        if len(self._buf) >= self._wake_at or self._reset or self._drained:
            self._wake.set()

    def _sized(self, payload: int) -> None:
        """Follow the size of this stream's messages: up at once, down slowly."""
        seen = payload + _FRAME_OVERHEAD
        self._msg_bytes = max(seen, self._msg_bytes - (self._msg_bytes >> 4)) if self._msg_bytes else seen

    def _status(self, status: str, description: str, pending: str | None) -> None:
        if status in ("404", "408", "409"):
            # The pull request ended; what it did not deliver is credit no longer owed.
            if status == "409" and ("Deleted" in description or "Leadership" in description):
                self._reset = True
            self._credit -= int(pending) if pending else self._credit
        self._credit = max(self._credit, 0)
        self._wake.set()

    async def _pull(self) -> None:
        # Messages asked for and not yet here wait in nats-server's buffer for this
        # connection, which it drops as a slow consumer past 64 MB. Two batches of
        # idle maps (2 KB each in a 48-replica fleet, 20 KB at 500) can pass that
        # whenever the reader stalls for a moment, so the window is in bytes too.
        # Before the first message, assume the largest the server allows (a few messages).
        size = self._msg_bytes or (getattr(self.bus.nc, "max_payload", 0) or 1 << 20) + _FRAME_OVERHEAD
        window = max(1, min(self.batch * 2, self.max_bytes_in_flight // size))
        self._wake_at = max(1, min(self.batch, window // 2))
        want = window - self._credit
        if want < (window + 1) // 2:
            return
        req = json.dumps({"batch": want, "expires": self.expires_ns}).encode()
        await self.bus.nc.publish(
            f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self._consumer}", req, reply=self._inbox
        )
        self._credit += want

    async def batches(self) -> AsyncIterator[list[RawMsg]]:
        """Yield lists of messages in stream order until ``stop_at`` (or forever)."""
        if self.stop_at is not None and self.next_seq > self.stop_at:
            return
        self._inbox = self.bus.nc.new_inbox()
        self._sub = await self.bus.nc.subscribe(self._inbox, cb=self._on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1)
        self.bus._raw_handlers[self._sub._id] = self._on_raw
        self.bus._frame_handlers[b"%d" % self._sub._id] = self._on_frames
        try:
            await self._create_consumer()
            silent_since = asyncio.get_running_loop().time()
            while True:
                if self._reset or self._consumer == "":
                    self.resets += 1
                    await self._delete_consumer()
                    self._buf.clear()
                    await self._create_consumer()
                if self.stop_at is not None and self._drained and not self._buf:
                    return
                await self._pull()
                if not self._buf:
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), timeout=self._idle_s + 3)
                    except TimeoutError:
                        # No message and no status for a whole request: the consumer is gone
                        # (a server restart drops memory consumers). Recreate it.
                        if asyncio.get_running_loop().time() - silent_since > self._idle_s + 3:
                            self._reset = True
                        continue
                silent_since = asyncio.get_running_loop().time()
                if not self._buf:
                    continue
                out, self._buf = self._buf, []
                if self.stop_at is not None and (out[-1].seq >= self.stop_at or self._drained):
                    out = [x for x in out if x.seq <= self.stop_at]
                    self.next_seq = max(self.next_seq, min(out[-1].seq if out else 0, self.stop_at) + 1)
                    if out:
                        yield out
                    return
                self.next_seq = out[-1].seq + 1
                yield out
        finally:
            self.bus._raw_handlers.pop(self._sub._id, None)
            self.bus._frame_handlers.pop(b"%d" % self._sub._id, None)
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            await self._delete_consumer()


@dataclass
class _Pending:
    subject: str
    payload: bytes
    msg_id: str


class Outbox:
    """A bounded queue of events, delivered in order and exactly once.

    ``put`` never blocks and never talks to the network; ``run`` drains the
    queue, retrying each event with its own ``Nats-Msg-Id`` until the server
    acknowledges it, however long the outage. When the queue is full, ``put``
    raises OutboxFullError: the caller decides, nothing is dropped silently.
    """

    def __init__(self, bus: Bus, maxlen: int) -> None:
        self.bus = bus
        self.maxlen = maxlen
        self._queue: deque[_Pending] = deque()
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.delivered = 0
        self.duplicates = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, event: m.Event, *, msg_id: str | None = None) -> None:
        if len(self._queue) >= self.maxlen:
            raise OutboxFullError(
                f"the outbox holds {self.maxlen} undelivered events; NATS has been unreachable too long"
            )
        payload = m.encode(event)
        self._queue.append(_Pending(subjects.subject_for(event), payload, msg_id or subjects.msg_id(event, payload)))
        self._idle.clear()
        self._ready.set()

    async def run(self) -> None:
        """Deliver forever; cancel to stop (what is queued stays queued)."""
        while True:
            if not self._queue:
                self._idle.set()
                self._ready.clear()
                await self._ready.wait()
                continue
            item = self._queue[0]
            try:
                ack = await self.bus.publish_bytes(item.subject, item.payload, item.msg_id, timeout=None)
            except PermissionDeniedError as e:
                # It can never succeed, and retrying would block everything behind it.
                log.error("outbox: %s; dropping that event", e)
                self._queue.popleft()
                self.refused += 1
                continue
            except PublishError as e:
                log.warning("outbox: %s", e)
                await asyncio.sleep(1.0)
                continue
            self._queue.popleft()
            self.delivered += 1
            self.duplicates += ack.duplicate

    async def flush(self, timeout: float = 10.0) -> None:  # noqa: ASYNC109 - public API
        """Wait until everything queued is acknowledged."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=timeout)
        except TimeoutError as e:
            raise PublishError(f"{len(self._queue)} events still undelivered after {timeout:.0f}s") from e
