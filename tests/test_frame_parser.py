"""The parser's fast lane for stream readers, on a real connection: bytes cut anywhere, same result."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from nats.errors import ProtocolError
from nats.protocol.parser import Parser

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus, Frame, FrameParser
from llmgw.config import Settings

T0 = datetime(2026, 11, 1, 10, 0, tzinfo=UTC)
HDR = b"NATS/1.0\r\nNats-Msg-Id: x\r\n\r\n"
STATUS = b"NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 5\r\n\r\n"
SID, OTHER = 7001, 9001  # far above what the test's connection has subscribed


def delivery(sid: int, seq: int, data: bytes, *, domain: bool = False) -> bytes:
    """A JetStream delivery as nats-server writes it, with the short or the domain form of the reply."""
    tail = b"S.C.1.%d.%d.1772445600000000000.%d" % (seq, seq, 9 - seq)
    reply = b"$JS.ACK._.ACC." + tail + b".tok" if domain else b"$JS.ACK." + tail
    return b"HMSG llmgw.fleet.n%d.lost %d %s %d %d\r\n%s%s\r\n" % (seq, sid, reply, len(HDR), len(HDR) + len(data), HDR, data)


# Deliveries for sid 7 around everything else a connection carries: +OK, a PING,
# a pull request's status message for the same subscription, a message for
# another subscription, and payloads that look like protocol lines.
STREAM = b"".join([
    delivery(SID, 1, b'{"a":1}'),
    delivery(SID, 2, b"HMSG fake 7001 x 1 2\r\n"),
    b"+OK\r\n",
    b"PING\r\n",
    delivery(SID, 3, b""),
    b"HMSG _INBOX.r %d %d %d\r\n%s\r\n" % (SID, len(STATUS), len(STATUS), STATUS),
    b"MSG other.subject %d 5\r\nhello\r\n" % OTHER,
    delivery(SID, 4, b'{"b":2}', domain=True),
    delivery(SID, 5, b"x" * 300, domain=True),
])
EXPECTED = [
    ("frame", b"llmgw.fleet.n1.lost", b'{"a":1}', b"1"),
    ("frame", b"llmgw.fleet.n2.lost", b"HMSG fake 7001 x 1 2\r\n", b"2"),
    ("frame", b"llmgw.fleet.n3.lost", b"", b"3"),
    ("status", b"_INBOX.r", STATUS),
    ("frame", b"llmgw.fleet.n4.lost", b'{"b":2}', b"4"),
    ("frame", b"llmgw.fleet.n5.lost", b"x" * 300, b"5"),
]


async def test_deliveries_cut_at_any_byte_arrive_whole_and_in_order(bus: Bus) -> None:
    got: list[tuple[bytes, ...]] = []

    def on_frames(frames: list[Frame]) -> None:
        for reply, subject, data in frames:
            got.append(("frame", subject, data, reply[-5] if len(reply) == 12 else reply[-4]))

    def on_raw(subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        got.append(("status", subject, headers or b""))

    bus._raw_handlers[SID] = on_raw  # the status message reaches readers through nats-py's parser
    try:
        for cut in range(len(STREAM) + 1):
            got.clear()
            parser = FrameParser(bus.nc, {b"%d" % SID: on_frames}, Parser(bus.nc))
            await parser.parse(STREAM[:cut])
            await parser.parse(STREAM[cut:])
            assert got == EXPECTED, f"cut at byte {cut}"
            assert not parser.buf
    finally:
        bus._raw_handlers.pop(SID, None)


async def test_a_size_that_is_not_a_number_is_a_protocol_error(bus: Bus) -> None:
    parser = FrameParser(bus.nc, {b"%d" % SID: lambda frames: None}, Parser(bus.nc))
    with pytest.raises(ProtocolError):
        await parser.parse(b"HMSG s %d $JS.ACK.S.C.1.1.1.1.0 x y\r\n" % SID)


async def test_a_reader_that_fails_does_not_stop_the_others(bus: Bus) -> None:
    seen: list[bytes] = []

    def broken(frames: list[Frame]) -> None:
        raise RuntimeError("a bug in one reader")

    parser = FrameParser(bus.nc, {b"%d" % SID: broken, b"%d" % OTHER: lambda fs: seen.extend(d for _, _, d in fs)},
                          Parser(bus.nc))
    await parser.parse(delivery(SID, 1, b"lost") + delivery(OTHER, 1, b"kept"))
    assert seen == [b"kept"]


async def test_fast_and_ordinary_paths_read_the_same_messages(bus: Bus, settings: Settings) -> None:
    events = [m.NodeLost(at=T0 + timedelta(seconds=i), node=f"n{i % 4}") for i in range(300)]
    await bus.publish_many(events)
    plain = await Bus.connect(settings, "llmgw-test-plain", fast_reads=False)
    try:
        assert type(plain.nc._ps) is Parser
        fast, slow = await asyncio.gather(*(
            _read_all(b, subjects.STREAM_FLEET) for b in (bus, plain)))
    finally:
        await plain.close()
    assert type(bus.nc._ps) is FrameParser
    assert [x[0] for x in fast] == list(range(1, 301))
    assert fast == slow


async def _read_all(bus: Bus, stream: str) -> list[tuple[int, str, bytes, int]]:
    last = await bus.stream_last_seq(stream)
    return [tuple(x) async for batch in bus.reader(stream, 1, batch=64, stop_at=last).batches() for x in batch]


# --- the nats-py internals the bus relies on -------------------------------------------------------

PINNED = "the nats-py minor version pinned in pyproject.toml"


def test_nats_py_is_the_minor_version_pyproject_pins() -> None:
    import tomllib
    from importlib.metadata import version
    from pathlib import Path

    deps = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(d for d in deps if d.startswith("nats-py"))
    low, high = (part.split("=")[-1].split("<")[-1] for part in pin.split(";")[0].split("]", 1)[1].split(","))
    installed = tuple(int(x) for x in version("nats-py").split(".")[:2])
    assert tuple(int(x) for x in low.split(".")[:2]) == installed, (
        f"nats-py {version('nats-py')} is installed but pyproject.toml pins {pin!r}: llmgw/bus/frames.py and "
        "llmgw/bus/deferred.py reach into nats-py's parser and transport; re-run these tests on the new version "
        "and move the pin only when they pass")
    assert tuple(int(x) for x in high.split(".")[:2]) == (installed[0], installed[1] + 1), pin


def test_the_parser_internals_frames_py_uses_are_still_there(bus: Bus) -> None:
    import inspect

    from nats.protocol import parser as nats_parser

    loud = f"nats-py changed an internal that llmgw/bus/frames.py relies on ({PINNED}); "
    assert nats_parser.AWAITING_CONTROL_LINE is not None, loud + "AWAITING_CONTROL_LINE is gone"
    assert list(inspect.signature(Parser.__init__).parameters) == ["self", "nc"], loud + "Parser(nc) changed"
    assert inspect.iscoroutinefunction(Parser.parse), loud + "Parser.parse is no longer a coroutine"
    p = Parser(bus.nc)
    for attr in ("buf", "state", "needed", "header_needed", "msg_arg"):
        assert hasattr(p, attr), loud + f"Parser.{attr} is gone (FrameParser copies it from the old parser)"
    assert p.state == nats_parser.AWAITING_CONTROL_LINE, loud + "a new parser no longer awaits a control line"
    process = getattr(type(bus.nc), "_process_msg", None)
    assert process is not None and inspect.iscoroutinefunction(process), loud + "Client._process_msg is gone"
    assert list(inspect.signature(process).parameters)[1:] == ["sid", "subject", "reply", "data", "headers"], \
        loud + "Client._process_msg(sid, subject, reply, data, headers) changed"
    assert type(bus.nc._ps) is FrameParser, loud + "the Bus no longer installs its parser (it fell back silently)"


def test_the_transport_still_imports_aiohttp_optionally() -> None:
    import inspect

    import nats.aio.transport as transport

    src = inspect.getsource(transport)
    loud = f"nats-py changed how it imports aiohttp, which llmgw/bus/deferred.py hides at start-up ({PINNED}); "
    assert "except ImportError:\n    aiohttp = None" in src, loud + "the ImportError fallback is gone"
    assert hasattr(transport, "aiohttp") and hasattr(transport, "multidict"), loud + "module globals renamed"


def test_the_bus_imports_nats_without_aiohttp_and_hands_it_over_for_websockets() -> None:
    import subprocess
    import sys

    script = (
        "import sys, llmgw.bus.connection\n"  # the face is lazy: what imports nats is what hides aiohttp
        "import nats.aio.transport as t\n"
        "assert 'aiohttp' not in sys.modules and t.aiohttp is None, 'aiohttp imported at start-up'\n"
        "from aiohttp import web\n"  # the router, after the bus: the real module
        "import aiohttp\n"
        "assert aiohttp.ClientSession and web.Application\n"
        "from llmgw.bus.deferred import websockets\n"
        "websockets()\n"
        "assert t.aiohttp is aiohttp, 'ws:// would find no aiohttp'\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
