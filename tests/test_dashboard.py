"""The web dashboard against a real nats-server and a real projector, read over real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from projection_events import inventory, small_fleet, spec, t
from running import until
from streams import publish

from llmgw import messages as m
from llmgw import subjects
from llmgw.apikeys import hash_key
from llmgw.bus import Bus
from llmgw.dashboard.app import Dashboard
from llmgw.dashboard.page import bar, booking_bar, duration
from llmgw.projections.runner import Projector

EVIL = "<script>alert(1)</script>"
EVIL_REASON = 'no room <img src=x onerror="alert(2)"> & more'


@contextlib.asynccontextmanager
async def projecting(bus: Bus) -> AsyncIterator[Projector]:
    """A live projector (no DuckDB file: the status service is what the dashboard reads), caught up."""
    projector = Projector(bus, None)
    task = asyncio.create_task(projector.run_forever())
    try:
        last = {s: await bus.stream_last_seq(s) for s in subjects.HISTORY_STREAMS}
        await until(lambda: all(projector.cursor.positions.get(s, 0) >= n for s, n in last.items()), "the fold")
        yield projector
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@contextlib.asynccontextmanager
async def serving(bus: Bus, **kw: Any) -> AsyncIterator[Dashboard]:
    board = Dashboard(bus, **kw)
    await board.start("127.0.0.1", 0)
    try:
        yield board
    finally:
        await board.stop()


async def updates(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The ``update`` events of a Server-Sent Events stream, decoded."""
    kind, data = "", ""
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
        elif not line and kind == "update":
            yield json.loads(data)
            kind, data = "", ""


async def until_update(stream: AsyncIterator[dict[str, Any]], section: str, text: str, limit_s: float = 15) -> str:
    """The first version of a section that holds ``text``."""
    async with asyncio.timeout(limit_s):
        async for u in stream:
            html = u["sections"].get(section, "")
            if text in html:
                return str(html)
    raise AssertionError(f"the stream ended before {section} showed {text!r}")


def test_durations_and_bars_read_right() -> None:
    assert [duration(x) for x in (None, -1, 5, 192, 7500, 200_000)] == ["-", "-", "5s", "3m 12s", "2h 05m", "2d 07h"]
    # 1 used GPU of 400 still shows (at least 1% wide), and the parts never run past the end.
    one = bar((("used", 1), ("free", 399)), 400)
    assert 'class="used" x="0.00" y="0" width="1.00"' in one and 'width="99.00"' in one


def test_a_card_bar_shows_each_booking_and_what_the_engines_hold() -> None:
    two = booking_bar((("a-r1", 10240), ("b-r1", 6144)), 9216, 46068)
    assert 'class="booked b0" x="0.00" y="0" width="22.23"' in two
    assert 'class="booked b1" x="22.23" y="0" width="13.34"' in two  # beside the first, in the other shade
    assert 'class="inuse" x="0" y="7.5" width="20.01"' in two
    # An engine more than 10 % past what its replicas booked is drawn as such; a card never runs past its end.
    over = booking_bar((("a-r1", 10240),), 12000, 10240 * 4)
    assert 'class="inuse over"' in over
    full = booking_bar((("a-r1", 90_000),), None, 81559)
    assert 'width="100.00"' in full and "inuse" not in full


async def test_shared_gpus_list_who_booked_how_much_and_what_their_engines_hold(bus: Bus) -> None:
    small = m.ModelSpec(name="s1", source="./s1.gguf", precision="q8_0", engine="llama.cpp", gpu_class="L40S-48GB",
                        context=4096, gib_per_gpu=10.0)

    def shared(rid: str, mib: int) -> m.ReplicaPlaced:
        return m.ReplicaPlaced(at=t(20), replica_id=rid, model=rid[:-3], nodes=("n4",), spec=small, fabric="pcie",
                               gpus=(m.GpuRef(node="n4", index=1, uuid="GPU-n4-1", mib=mib),))

    await publish(bus, [*small_fleet(), shared("s1-r1", 10240), shared("s2-r1", 6144),
                        m.ReplicaStateChanged(at=t(21), replica_id="s1-r1", model="s1", node="n4", state="healthy",
                                              endpoint="http://n4:8001", observed_memory_mib=9216)])
    await bus.publish_core(subjects.heartbeat("n1"), m.encode(m.HeartbeatSent(
        at=t(22), node="n1", boot_id="b", seq=1, gpus=(m.GpuSample(index=0, utilization_pct=40),))))
    async with projecting(bus) as projector, serving(bus) as board, aiohttp.ClientSession() as http:
        await until(lambda: projector.gpu_samples is not None and bool(projector.gpu_samples.latest), "GPU samples")
        async with http.get(board.url) as r:
            page = await r.text()
        async with http.get(board.url + "api/status") as r:
            status = await r.json()
            report = status["report"]
    # Issue 45, finding 3: an open dashboard (no login) does not say where the engines listen.
    assert "n4:8001" not in page and "n4:8001" not in json.dumps(status)
    assert report["replica_list"] and all(r["endpoint"] == "" for r in report["replica_list"])
    booked = {(b["node"], b["index"]): b for b in report["gpu_bookings"]}
    assert booked[("n4", 1)]["replicas"] == [["s1-r1", 10240], ["s2-r1", 6144]]
    assert booked[("n4", 1)]["booked_mib"] == 16384 and booked[("n4", 1)]["memory_mib"] == 46068
    gpus = page[page.index('id="gpus"'):]
    assert "a tile per held GPU:" in gpus and "held by its engine (measured)" in gpus  # legends
    assert "a cell per GPU: utilization %" in gpus
    # The shared card: its bar, who booked how much, and what the one measured engine holds.
    tile = gpus[gpus.index('data-gpu="n4/1"'):]
    tile = tile[:tile.index("</ul>")]
    assert ('<div class="booking shared" title="GPU 1 on n4: 2 replicas booked 16 GiB of 45 GiB; 29 GiB free; '
            'their engines hold 9.0 GiB" data-gpu="n4/1">') in gpus
    assert "GPU 1 · 16 GiB of 45 GiB" in tile
    assert '<span class="rid">s1-r1</span> 10 GiB<span class="used"> · 9.0 GiB used</span>' in tile
    assert '<span class="rid">s2-r1</span> 6.0 GiB</li>' in tile  # not measured: no figure
    assert 'class="booked b1" x="22.23" y="0" width="13.34"' in tile
    # n4 sent no heartbeat yet: its bookings show all the same; n1's whole card is booked by r-qwen alone.
    assert '<span class="node">n4</span><span class="cls">L40S-48GB</span><span class="cells empty">no samples yet' in gpus
    whole = gpus[gpus.index('data-gpu="n1/0"'):]
    assert whole.index("GPU 0 · 80 GiB of 80 GiB") < whole.index("</ul>") and "r-qwen" in whole
    # The cell of a held GPU says who holds it (issue 43, finding 9: the tiles did not).
    assert 'class="gpu u4 held" title="GPU 0: held by r-qwen; 40% busy' in gpus
    assert '<div class="booking" title="GPU 0 on n1: 1 replica booked 80 GiB of 80 GiB; 0.0 GiB free"' in gpus


async def test_the_page_shows_the_fleet_and_escapes_what_it_did_not_write(bus: Bus) -> None:
    evil = spec(EVIL, gpu_class="L40S-48GB", tp=8)
    await publish(bus, [*small_fleet(), m.ModelDeclared(at=t(20), spec=evil),
                        m.ModelUnplaceable(at=t(21), name=EVIL, reason=EVIL_REASON)])
    await bus.publish_core(subjects.heartbeat("n1"), m.encode(m.HeartbeatSent(
        at=t(22), node="n1", boot_id="b", seq=1,
        gpus=(m.GpuSample(index=0, utilization_pct=87, memory_used_mib=70_000, memory_total_mib=81_559),))))
    async with projecting(bus) as projector, serving(bus) as board, aiohttp.ClientSession() as http:
        await until(lambda: projector.gpu_samples is not None and bool(projector.gpu_samples.latest), "GPU samples")
        async with http.get(board.url) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
            assert "script-src 'self'" in r.headers["Content-Security-Policy"]
            page = await r.text()
        async with http.get(board.url + "static/dashboard.js") as r:
            assert r.status == 200 and "EventSource" in await r.text()
        async with http.get(board.url + "static/../dashboard.py") as r:
            assert r.status == 404
    # Every model and GPU class, the unplaceable reason, a replica with its idle time, GPU use.
    for text in ("llama-70b", "qwen-8b", "gemma-9b", "deepseek-v3", "H100-80GB", "L40S-48GB", "r-qwen",
                 "needs 4 whole H100-80GB nodes", "ib-a", "n5", "live ·", "utilization 87%"):
        assert text in page, text
    assert 'title="GPU 0: held by r-qwen; 87% busy, 68 GiB / 80 GiB, -, -" data-held="r-qwen">87<' in page
    # What an agent or an operator wrote is text on the page, never markup.
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and EVIL not in page
    assert "&lt;img src=x onerror=&quot;alert(2)&quot;&gt; &amp; more" in page and "<img" not in page
    assert page.count("<script") == 1  # the page's own, from static/


async def test_a_fault_reaches_an_open_page_and_many_pages_cost_one_request(bus: Bus) -> None:
    await publish(bus, small_fleet())
    async with projecting(bus), serving(bus, interval_s=60) as board, aiohttp.ClientSession() as http:
        await until(lambda: len(board.events) == len(small_fleet()) - 4, "the timeline (the idle maps are not in it)")
        responses = [await http.get(board.url + "events") for _ in range(20)]
        try:
            streams = [updates(r) for r in responses]
            for s in streams:
                await until_update(s, "conn", "live")
            # Twenty pages, one question to the projector: they share one view.
            assert board.clients == 20 and board.asked == 1
            await publish(bus, [m.GpuHealthChanged(at=t(30), node="n2", gpu_index=1, gpu_uuid="GPU-n2-1",
                                                   healthy=False, reasons=("xid 79: GPU has fallen off the bus",))])
            timeline = await until_update(streams[0], "events", "xid 79")
            assert "GPU 1 unhealthy: xid 79: GPU has fallen off the bus" in timeline and 'class="event bad"' in timeline
            # The event makes it ask again at once, not an interval (a minute here) later: the bar shows it.
            await until_update(streams[0], "capacity", "2 unhealthy")
            assert board.asked == 2
        finally:
            for r in responses:
                r.close()
    await until(lambda: board.clients == 0, "the pages to close")


async def test_the_page_says_reconnecting_while_the_projector_is_away_then_catches_up(bus: Bus) -> None:
    await publish(bus, small_fleet())
    async with serving(bus, interval_s=0.2) as board, aiohttp.ClientSession() as http:
        async with http.get(board.url) as r:
            assert "reconnecting: no projector answers on the bus" in await r.text()
        async with http.get(board.url + "events") as r:
            stream = updates(r)
            async with projecting(bus):
                await until_update(stream, "conn", "live ·")
                models = board.sections["models"]
            assert "llama-70b" in models
            # The projector goes away: the page says so and keeps what it last showed.
            await until_update(stream, "conn", "reconnecting")
            assert board.sections["models"] == models
            await publish(bus, [m.ModelDeclared(at=t(40), spec=spec("late-model"))])
            async with projecting(bus):  # back: it folds from the start and the page catches up
                assert "late-model" in await until_update(stream, "models", "late-model")


async def test_api_keys_guard_everything_but_the_login_and_static_files(bus: Bus, tmp_path: Path) -> None:
    async with serving(bus, api_keys=[hash_key("s3cret")]) as board, \
            aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        async with http.get(board.url) as r:
            assert r.status == 401 and 'name="key"' in await r.text()
        for path in ("events", "api/status"):
            async with http.get(board.url + path) as r:
                assert r.status == 401 and "invalid API key" in await r.text()
        async with http.get(board.url + "static/dashboard.css") as r:
            assert r.status == 200
        async with http.get(board.url + "api/status", headers={"Authorization": "Bearer s3cret"}) as r:
            assert r.status == 200 and (await r.json())["live"] is False
        async with http.get(board.url + "api/status", headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
        async with http.post(board.url + "login", data={"key": "wrong"}, allow_redirects=False) as r:
            assert r.status == 401 and "not accepted" in await r.text()
        async with http.post(board.url + "login", data={"key": "s3cret"}, allow_redirects=False) as r:
            assert r.status == 303 and "HttpOnly" in r.headers["Set-Cookie"] and "SameSite=Strict" in r.headers["Set-Cookie"]
        async with http.get(board.url) as r:  # the cookie from the login
            assert r.status == 200 and "waiting for the projector" in await r.text()


async def test_a_node_without_samples_and_a_fleet_without_models_read_plainly(bus: Bus) -> None:
    await publish(bus, [inventory("n1", "ib-a", 2, t(0))])
    async with projecting(bus), serving(bus) as board, aiohttp.ClientSession() as http:
        async with http.get(board.url) as r:
            page = await r.text()
    assert "no models declared" in page and "no GPU samples yet" in page and "1 node · 0 lost" in page
    assert "0 used · 2 free · 0 unhealthy · 0 lost · 2 total" in page


async def test_a_port_it_cannot_take_is_one_clear_error(bus: Bus) -> None:
    import socket

    from llmgw.errors import ConfigError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        board = Dashboard(bus)
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port} .*pick another --listen"):
            await board.start("127.0.0.1", port)


async def test_a_parked_model_reads_as_model_list_says_and_a_faulted_gpu_is_marked(bus: Bus) -> None:
    """A model scaled to nothing is 0/1 healthy, as `ctl model list` says; an XID'd GPU is not drawn idle."""
    fleet = small_fleet()
    await publish(bus, [*fleet,
                        m.GpuHealthChanged(at=t(30), node="n1", gpu_index=1, gpu_uuid="GPU-n1-1", healthy=False,
                                           reasons=("xid 79: GPU has fallen off the bus",)),
                        m.ReplicaStopped(at=t(31), replica_id="r-gemma", model="gemma-9b", reason="idle")])
    await bus.publish_core(subjects.heartbeat("n1"), m.encode(m.HeartbeatSent(
        at=t(32), node="n1", boot_id="b", seq=1,
        gpus=(m.GpuSample(index=0, utilization_pct=50), m.GpuSample(index=1, utilization_pct=0)))))
    async with projecting(bus) as projector, serving(bus) as board, aiohttp.ClientSession() as http:
        await until(lambda: projector.gpu_samples is not None and bool(projector.gpu_samples.latest), "GPU samples")
        async with http.get(board.url) as r:
            page = await r.text()
    assert ">0/1 healthy<" in page  # gemma-9b, parked: healthy of wanted
    assert 'class="gpu bad" title="GPU 1 UNHEALTHY: xid 79: GPU has fallen off the bus">✕<' in page
    assert 'title="GPU 0: held by r-qwen; 50% busy' in page


def ctl_key(name: str, **kw: Any) -> tuple[str, m.KeyDeclared]:
    from llmgw import ctl

    secret, key_id, salt, digest = ctl.new_key_secret()
    return secret, m.KeyDeclared(at=m.utcnow(), name=name, lookup_id=key_id, salt=salt, digest=digest, **kw)


async def test_ctl_keys_open_it_by_scope_and_only_an_admin_sees_tenants(bus: Bus) -> None:
    """Seen (issue 43, finding 9): `ctl key create` keys did not protect the dashboard, which showed
    tenants' names and usage to anyone who reached it."""
    _, client = ctl_key("team-a-ci", tenant="team-a", tokens_per_day=100)
    use = {"team-a-ci": {"qwen-8b": m.KeyUse(requests=3, prompt_tokens=90, completion_tokens=9)}}
    await publish(bus, [*small_fleet(), client])
    await publish(bus, [m.IdleMapPublished(at=m.utcnow(), router="rt", boot_id="b", tick=1, callers=use)])

    async def seen(http: aiohttp.ClientSession, url: str, key: str | None = None) -> tuple[int, str, Any]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with http.get(url, headers=headers) as r:
            page = await r.text()
        async with http.get(url + "api/status", headers=headers) as r:
            doc = await r.json() if r.status == 200 else None
        return r.status, page, doc

    async with projecting(bus), serving(bus) as board, aiohttp.ClientSession() as http:
        # Only a client key exists: nobody can log in, so the page is open, but whose usage it is is not shown.
        status, page, doc = await seen(http, board.url)
        await until(lambda: board.report is not None and bool(board.report.tenants), "the tenants' usage")
        status, page, doc = await seen(http, board.url)
        assert status == 200 and doc["scope"] == "open" and "team-a" not in page and "team-a" not in json.dumps(doc)
        assert "log in with an admin key" in page and doc["report"]["tenants"] == []
        assert "1 key at 80 % or more" in page  # that one is near its limit is the fleet's business; whose is not
        viewer_secret, viewer = ctl_key("oncall", scope="viewer")
        admin_secret, admin = ctl_key("ops", scope="admin")
        await publish(bus, [viewer, admin])
        await until(lambda: board.login_required, "the viewer's key read")
        await until(lambda: len(board.declared) == 3, "every key read")
        status, page, _ = await seen(http, board.url)
        assert status == 401 and 'name="key"' in page  # a key exists that opens it: the page asks for one
        # A client's key is no login; a viewer sees the fleet but no tenant; an admin sees them.
        client_secret = ctl_key("x")[0]
        assert (await seen(http, board.url, client_secret))[0] == 401
        status, page, doc = await seen(http, board.url, viewer_secret)
        assert status == 200 and doc["scope"] == "viewer" and "qwen-8b" in page and "team-a" not in page
        assert not any(e.get("tenant") == "team-a" for e in doc["events"])  # the keys' records are an admin's
        status, page, doc = await seen(http, board.url, admin_secret)
        assert status == 200 and doc["scope"] == "admin" and "team-a" in page
        assert [t["tenant"] for t in doc["report"]["tenants"]] == ["team-a"]
        # The login form takes the viewer's key; once it is revoked its session ends.
        jar = aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))
        async with jar:
            async with jar.post(board.url + "login", data={"key": viewer_secret}, allow_redirects=False) as r:
                assert r.status == 303
            async with jar.get(board.url) as r:
                assert r.status == 200 and "team-a" not in await r.text()
            await publish(bus, [m.KeyRevoked(at=m.utcnow(), name="oncall")])
            await until(lambda: len(board.declared) == 2, "the revocation read")
            async with jar.get(board.url) as r:
                assert r.status == 401


def test_a_control_plane_that_is_down_is_the_first_thing_the_page_says() -> None:
    """A moment inside a recorded stop (what a dashboard outside `up` shows while `up` is away): the attention
    list says so first, every model and replica reads down in red, and the timeline names the stop and start."""
    from llmgw.dashboard.page import render
    from llmgw.fleet.fold import Checkpoint
    from llmgw.fleet.state import apply
    from llmgw.fleet.status import report

    qwen = spec("qwen-8b")
    events: list[m.Event] = [
        m.ControlPlaneStarted(at=t(0), boot_id="b1"), inventory("n1", "ib-a", 1, t(0)),
        m.ModelDeclared(at=t(0), spec=qwen),
        m.ReplicaPlaced(at=t(0), replica_id="qwen-r1", model="qwen-8b", nodes=("n1",), fabric="ib-a", spec=qwen,
                        gpus=(m.GpuRef(node="n1", index=0, uuid="GPU-n1-0"),)),
        m.ReplicaStateChanged(at=t(1), replica_id="qwen-r1", model="qwen-8b", node="n1", state="healthy",
                              endpoint="http://n1:8000"),
        m.ControlPlaneStopped(at=t(60), boot_id="b1", reason="SIGTERM")]
    c = Checkpoint()
    for i, e in enumerate(events, 1):
        apply(c.state, e, i)
    sections = render(report(c.state, t(90), replicas=True), reversed(events), ok=True, why="", at=None)
    first = sections["attention"].split("</li>")[0]
    assert 'class="bad"' in first and "control plane down since 11:00:00 UTC" in first, sections["attention"]
    assert sections["models"].count('<span class="badge bad">down</span>') == 2  # the model and its replica
    assert "badge good" not in sections["models"] and ">0/1 healthy<" in sections["models"]
    stop = sections["events"].split("</li>")[0]
    assert 'class="event bad"' in stop and "control plane" in stop and "stopped (SIGTERM)" in stop, stop
    back = render(report(c.state, t(120)), [m.ControlPlaneStarted(at=t(120), boot_id="b2", previous_boot_id="b1",
                                                                  last_seen=t(110))], ok=True, why="", at=None)
    assert 'class="event good"' in back["events"] and "started; down since 11:50:00 UTC (a stop nothing recorded)" in back["events"]
