"""Issue 45's findings 2, 6 and part of 9: what a forged snapshot, a malformed header or a stored key
record must not give away, each against a real nats-server (and a real DuckDB where one is read)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import duckdb
import msgspec
import pytest
from analyst_history import project
from projection_events import small_fleet
from running import until
from streams import fresh_streams, publish
from test_keys import declared
from test_snapshots import _forge, restarted_router

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.clientsockets import unreadable
from llmgw.dashboard.app import Dashboard
from llmgw.fleet.fold import Checkpoint
from llmgw.fleet.replay import replay
from llmgw.projections.export import export_parquet
from llmgw.projections.store import Store
from llmgw.router.quotas import utc_day
from llmgw.router.server import Router

SECRET = "sk-llmgw-0123456789abcdef-THE-SECRET-PART"


@contextlib.asynccontextmanager
async def a_router(bus: Bus) -> AsyncIterator[str]:
    r = Router(bus, "router-sec", tick_s=3600)
    await r.start("127.0.0.1", 0)
    try:
        yield r.url
    finally:
        await r.stop()


@contextlib.asynccontextmanager
async def a_dashboard(bus: Bus) -> AsyncIterator[str]:
    board = Dashboard(bus)
    url = await board.start("127.0.0.1", 0)
    try:
        yield url
    finally:
        await board.stop()


async def send(url: str, data: bytes) -> bytes:
    """Raw bytes on a fresh connection; whatever comes back before the server closes it."""
    u = urlsplit(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(10):
            return await reader.read(1 << 20)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


# What the issue sent: a trailing control byte, a value over aiohttp's line limit, a space before the colon.
MALFORMED = {
    "control byte": f"Authorization: Bearer {SECRET}\x01\r\n".encode(),
    "9,000 bytes": f"Authorization: Bearer {SECRET}{'x' * 9000}\r\n".encode(),
    "space before the colon": f"Authorization : Bearer {SECRET}\r\n".encode(),
    "lower case, bad byte": f"authorization: Bearer {SECRET}\x7f\r\n".encode(),
    "proxy": f"Proxy-Authorization: Basic {SECRET}\x01\r\n".encode(),
}


@pytest.mark.parametrize("server", ["router", "dashboard"])
@pytest.mark.parametrize("header", list(MALFORMED), ids=list(MALFORMED))
async def test_a_malformed_authorization_header_never_puts_the_secret_in_the_log(
        bus: Bus, caplog: pytest.LogCaptureFixture, server: str, header: str) -> None:
    caplog.set_level(logging.DEBUG)
    serving = a_router(bus) if server == "router" else a_dashboard(bus)
    async with serving as url:
        path = "/v1/chat/completions" if server == "router" else "/api/status"
        got = await send(url, f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode() + MALFORMED[header] + b"\r\n")
    assert got.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4")), got[:200]
    assert SECRET[20:].encode() not in got, "the answer echoes the secret"
    seen = [r for r in caplog.records if SECRET[20:] in r.getMessage() or (
        r.exc_info and SECRET[20:] in logging.Formatter().formatException(r.exc_info))]
    assert not seen, [r.getMessage()[:300] for r in seen]
    # Something was still said about the refused request (one line, with the secret's place marked).
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said, "the refusal was not logged"


@pytest.mark.parametrize("said", [
    f"Invalid header value char:\n\n  b'Authorization: Bearer {SECRET}\\x01'\n  ^",  # the C parser's
    f"Got more than 8190 bytes when reading: b'Bearer {SECRET}xxxx...'.",
    f"Invalid HTTP header: 'Authorization : Bearer {SECRET}'",  # the pure-Python parser's (str repr)
    f"Invalid HTTP header: \"Authoriz'ation: Bearer {SECRET}\"",  # a quote inside: the other quotes
    f"Bad header Authorization: Bearer {SECRET}",  # unquoted: cut after the credential's name
])
def test_what_a_parser_quotes_of_a_request_is_left_out(said: str) -> None:
    line = unreadable(None, said)
    assert SECRET[8:] not in line and "\n" not in line, line
    assert "not logged" in line, line  # a person still sees that something was left out, and where


# --- finding 2: a forged fold snapshot's keys ---------------------------------------------------------

_, KEPT = declared("kept", requests_per_minute=10, tokens_per_day=1000)
_, GONE = declared("gone")
_, EVIL_KEY = declared("evil", priority="high")


def _added(c: Checkpoint) -> None:
    c.state.keys["evil"] = EVIL_KEY  # a key the streams never declared, high priority, no limits


def _revived(c: Checkpoint) -> None:
    c.state.keys["gone"] = GONE  # a revoked key brought back, as it was declared


def _unlimited(c: Checkpoint) -> None:
    c.state.keys["kept"] = msgspec.structs.replace(KEPT, requests_per_minute=None, tokens_per_day=None)


@pytest.mark.parametrize("change, why", [
    (_added, "key 'evil' is not live"),
    (_revived, "key 'gone' is not live"),
    (_unlimited, "key 'kept' is not what"),
])
async def test_a_snapshot_cannot_add_bring_back_or_unlimit_a_key(
        bus: Bus, change: Callable[[Checkpoint], None], why: str) -> None:
    await fresh_streams(bus)
    await publish(bus, [*small_fleet()[:17], KEPT, GONE, m.KeyRevoked(at=m.utcnow(), name="gone")])
    forged = await _forge(bus, change)
    warned: list[str] = []
    c = await replay(bus, warn=warned.append)
    assert len(warned) == 1 and forged in warned[0] and why in warned[0], warned
    assert set(c.state.keys) == {"kept"} and c.state.keys["kept"] == KEPT
    # A router started now admits by the stream's keys, never the snapshot's.
    sink = await restarted_router(bus)
    assert sink.started_from != forged
    assert {k.name: k for k in sink.keys_by_id.values()} == {"kept": KEPT}


async def test_a_snapshot_whose_keys_are_the_streams_is_used(bus: Bus) -> None:
    await fresh_streams(bus)
    await publish(bus, [*small_fleet()[:17], KEPT, GONE, m.KeyRevoked(at=m.utcnow(), name="gone")])
    honest = await _forge(bus, lambda c: None)
    sink = await restarted_router(bus)
    assert sink.started_from == honest
    assert {k.name for k in sink.keys_by_id.values()} == {"kept"}


_, DAILY = declared("daily", tokens_per_day=1000)


def _todays_map(router: str, tokens: int, at: datetime | None = None) -> m.IdleMapPublished:
    """What another router's (or an earlier boot's) map says ``daily`` used today."""
    return m.IdleMapPublished(at=at or m.utcnow(), router=router, boot_id=f"{router}-earlier", tick=1,
                              callers={"daily": {"k": m.KeyUse(requests=1, prompt_tokens=tokens)}})


def _totals(router: str, tokens: int) -> m.KeyDayTotals:
    return m.KeyDayTotals(at=m.utcnow(), router=router, boot_id=f"{router}-earlier", day=utc_day(time.time()),
                          tokens={"daily": tokens})


async def _tokens_today_at_start(bus: Bus) -> int:
    """What a router starting now counts of ``daily``'s day, once it has read the usage stream."""
    r = Router(bus, "rt-late", tick_s=3600)
    await r.start("127.0.0.1", 0)
    try:
        await until(r.ticks.usage_caught_up.is_set, "the late router read the usage stream")
        counts = r.quotas.counts.get("daily")
        return 0 if counts is None else counts.tokens_today(utc_day(time.time()))
    finally:
        await r.stop()


async def test_a_snapshot_cannot_give_a_key_its_day_back(bus: Bus) -> None:
    """A forged snapshot's usage of today (``key_usage``, which no control message vouches for) is never
    where a router starts its day: it reads the day's maps from the usage stream."""
    await fresh_streams(bus)
    await publish(bus, [*small_fleet()[:17], DAILY, _todays_map("rt-a", 600), _todays_map("rt-b", 400)])
    await _forge(bus, lambda c: c.state.key_usage.pop("daily"))
    assert await _tokens_today_at_start(bus) == 1000


async def test_a_router_starting_counts_each_routers_day_totals_and_the_maps_after_them(bus: Bus) -> None:
    """Each router's last ``KeyDayTotals`` and only its maps after them (not a day of maps); a router that
    says no totals (an earlier version) for its last minute; this router's own name's day is published
    again at its start, with what its earlier boots' maps said."""
    await fresh_streams(bus)
    hours_ago = m.utcnow() - timedelta(hours=2)
    await publish(bus, [*small_fleet()[:17], DAILY,
                        _todays_map("rt-a", 600, hours_ago), _totals("rt-a", 600),  # the map is in its totals
                        _todays_map("rt-a", 250), _totals("rt-late", 30), _todays_map("rt-late", 20),
                        _todays_map("rt-old", 100)])
    assert await _tokens_today_at_start(bus) == 600 + 250 + 30 + 20 + 100
    got = await bus.last_message(subjects.STREAM_USAGE, subjects.usage_day("rt-late"))
    assert got is not None
    said = m.USAGE_DECODER.decode(got[1])
    assert isinstance(said, m.KeyDayTotals) and said.tokens == {"daily": 50}  # its earlier boots' 30 + 20


# --- finding 9: key salts and digests stay with the readers of control that need them ---------------


def test_no_salt_or_digest_in_duckdbs_events_or_the_parquet_export(tmp_path: Path) -> None:
    db = tmp_path / "llmgw.duckdb"
    project(db, [*small_fleet(), KEPT]).close()
    con = duckdb.connect(str(db), read_only=True)
    try:
        (doc,) = [json.loads(r[0]) for r in con.execute("SELECT json FROM events WHERE type = 'KeyDeclared'").fetchall()]
    finally:
        con.close()
    assert "salt" not in doc and "digest" not in doc, doc
    assert doc["name"] == "kept" and doc["tokens_per_day"] == 1000  # what analysts read stays
    out = tmp_path / "out"
    export_parquet(db, out)
    for f in out.rglob("*.parquet"):
        data = f.read_bytes()
        assert KEPT.salt.encode() not in data and KEPT.digest.encode() not in data, f


async def test_the_dashboards_status_api_shows_keys_without_salt_or_digest(bus: Bus) -> None:
    from llmgw.apikeys import hash_key

    await publish(bus, [*small_fleet()[:5], KEPT])
    board = Dashboard(bus, api_keys=[hash_key("s3cret")])  # the keys' records are an admin's (issue 43, finding 9)
    url = await board.start("127.0.0.1", 0)
    async with contextlib.AsyncExitStack() as stack, aiohttp.ClientSession() as s:
        stack.push_async_callback(board.stop)

        async def shown() -> str:
            async with s.get(url + "api/status", headers={"Authorization": "Bearer s3cret"}) as resp:
                return await resp.text()

        async def key_shown() -> bool:
            return '"KeyDeclared"' in await shown()

        await until(key_shown, "the key event on the dashboard")
        text = await shown()
    assert '"KeyDeclared"' in text and '"kept"' in text
    assert KEPT.salt not in text and KEPT.digest not in text


def test_a_file_written_before_keeps_no_key_secret_once_a_projector_opens_it(tmp_path: Path) -> None:
    db = tmp_path / "llmgw.duckdb"
    project(db, [*small_fleet(), KEPT]).close()
    con = duckdb.connect(str(db))
    try:  # as a projector of before this rule stored it: the payload as published
        con.execute("UPDATE events SET json = ? WHERE type = 'KeyDeclared'", [m.encode(KEPT).decode()])
    finally:
        con.close()
    Store(db).close()
    con = duckdb.connect(str(db), read_only=True)
    try:
        (doc,) = [json.loads(r[0]) for r in con.execute("SELECT json FROM events WHERE type = 'KeyDeclared'").fetchall()]
    finally:
        con.close()
    assert "salt" not in doc and "digest" not in doc and doc["requests_per_minute"] == 10, doc
