"""What comes off the wire: acks, raw stream messages, and the frame parser.

The parser cuts deliveries out of the socket's bytes in one pass. It is the only
code that reaches into nats-py's internals; its guard tests are
tests/test_frame_parser.py.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import AnyStr, NamedTuple

from llmgw.bus import deferred  # noqa: F401 - before nats: it hides aiohttp from nats-py's import

# isort: split
from nats.aio.client import Client as NatsClient
from nats.errors import ProtocolError
from nats.protocol.parser import AWAITING_CONTROL_LINE, Parser

log = logging.getLogger(__name__)


# What one reader may have asked nats-server for and not yet received: 3 readers on
# a connection stay far below the server's 64 MB slow-consumer limit (max_pending).
READER_BYTES_IN_FLIGHT = 8 << 20
# Per delivered message beyond its payload: the HMSG line with subject and $JS.ACK
# reply, and the Nats-Msg-Id header.
FRAME_OVERHEAD = 256


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


def ack_fields(t: Sequence[AnyStr]) -> tuple[AnyStr, AnyStr, AnyStr, AnyStr, AnyStr] | None:
    """(consumer, stream seq, delivery seq, stored ns, pending) of a JetStream reply split at the dots.

    $JS.ACK.<stream>.<consumer>.<dlv>.<sseq>.<dseq>.<ts>.<pending>, or with
    <domain>.<account> after ACK and a token at the end (12 parts).
    """
    if len(t) >= 12:
        return t[5], t[7], t[8], t[9], t[10]
    if len(t) >= 9:
        return t[3], t[5], t[6], t[7], t[8]
    return None


class FrameParser(Parser):
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
