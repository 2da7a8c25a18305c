"""Read a stream in order from a sequence, in batches, with a client-driven pull loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import socket
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from llmgw.bus import deferred  # noqa: F401 - before nats: it hides aiohttp from nats-py's import

# isort: split
import nats
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg

from llmgw import subjects
from llmgw.bus.frames import FRAME_OVERHEAD, READER_BYTES_IN_FLIGHT, Frame, RawMsg, ack_fields
from llmgw.errors import BusError

if TYPE_CHECKING:
    from llmgw.bus.connection import Bus

log = logging.getLogger(__name__)

_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9_-]+")


def consumer_name(who: str, stream: str) -> str:
    """``<who>-<stream>-<random>``: says whose it is in ``nats consumer ls``, and never collides with
    the consumer of a restarted process or of another reader of the same process."""
    return f"{_NOT_IN_NAME.sub('_', who)[:48] or 'llmgw'}-{stream}-{secrets.token_hex(4)}"


class StreamReader:
    """Read a stream in order from a sequence, in batches, following or up to ``stop_at``.

    An ephemeral, unacknowledged consumer starts at ``start_seq``; the caller's
    checkpoint (not the server) is the durable cursor, so a resumed reader
    starts exactly after what was committed. Gaps in the consumer's delivery
    sequence, a deleted consumer, or silence all recreate it after the last
    sequence handed out. ``say_drained``: hand out one empty batch the first time nothing is left to
    read (a filtered reader may find nothing at all). Each consumer is named after the bus connection's name
    (the process) and described with ``purpose``, so ``nats consumer ls`` and
    ``nats consumer info`` say whose it is and what for.
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
        purpose: str = "",
        say_drained: bool = False,
    ) -> None:
        self.bus = bus
        self.say_drained = say_drained
        self.purpose = purpose
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

    @property
    def drained(self) -> bool:
        """Nothing this reader matches was left on the server when its last messages came."""
        return self._drained

    def _description(self) -> str:
        why = f" ({self.purpose})" if self.purpose else ""
        what = f"replays {self.stream} from seq {self.next_seq} to {self.stop_at}" if self.stop_at is not None \
            else f"follows {self.stream} from seq {self.next_seq}"
        only = f", only {' '.join(self.filter_subjects)}" if self.filter_subjects else ""
        return (f"{self.bus.name}{why} {what}{only}; "
                f"host {socket.gethostname()} pid {os.getpid()}")[:1024]

    async def _create_consumer(self) -> None:
        name = consumer_name(self.bus.name, self.stream)
        config: dict[str, Any] = {
            "name": name,
            "description": self._description(),
            "deliver_policy": "by_start_sequence",
            "opt_start_seq": self.next_seq,
            "ack_policy": "none",
            "replay_policy": "instant",
            "inactive_threshold": int(30e9),
            "mem_storage": True,
            "num_replicas": 1,
            "max_waiting": 16,
        }
        # The named create API; with one filter, the filter is in the subject too (as nats-py and the
        # nats CLI send it), so nats.conf grants CREATE.<stream>.* and CREATE.<stream>.*.>.
        subject = subjects.js_consumer("CREATE", self.stream, name)
        if len(self.filter_subjects) == 1:
            config["filter_subject"] = self.filter_subjects[0]
            subject += "." + self.filter_subjects[0]
        elif self.filter_subjects:
            config["filter_subjects"] = self.filter_subjects
        req = json.dumps({"stream_name": self.stream, "config": config, "action": "create"}).encode()
        loop = asyncio.get_running_loop()
        # A cluster electing leaders, or a server coming back, answers "temporarily
        # unavailable" or not at all for a few seconds; a reader rides that out.
        deadline = loop.time() + self.bus.settings.request_timeout_s * 6
        delay = 0.1
        while True:
            problem = ""
            try:
                msg = await self.bus.guarded(subject, self.bus.nc.request(subject, req, timeout=self.bus.settings.request_timeout_s))
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
                    subjects.js_consumer("DELETE", self.stream, self._consumer), b"", timeout=1
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
            fields = ack_fields(t)
            if fields is None:
                continue  # not a delivery this reader can place
            consumer, sseq, dseq, ts, pending = fields
            self._stored(consumer.decode(), int(sseq), int(dseq), int(ts), pending == b"0", subject.decode(), data)

    async def _on_msg(self, msg: Msg) -> None:
        """The same through nats-py's ordinary path, when the fast one is not installed."""
        reply = msg.reply
        if reply.startswith("$JS.ACK."):
            fields = ack_fields(reply.split("."))
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
        seen = payload + FRAME_OVERHEAD
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
        size = self._msg_bytes or (getattr(self.bus.nc, "max_payload", 0) or 1 << 20) + FRAME_OVERHEAD
        window = max(1, min(self.batch * 2, self.max_bytes_in_flight // size))
        self._wake_at = max(1, min(self.batch, window // 2))
        want = window - self._credit
        if want < (window + 1) // 2:
            return
        req = json.dumps({"batch": want, "expires": self.expires_ns}).encode()
        await self.bus.nc.publish(
            subjects.js_consumer("MSG.NEXT", self.stream, self._consumer), req, reply=self._inbox
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
                if self.say_drained and self._drained and not self._buf:
                    self.say_drained = False
                    yield []
                await self._pull()
                if not self._buf:
                    self._wake.clear()
                    try:
                        async with asyncio.timeout(self._idle_s + 3):
                            await self._wake.wait()
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
