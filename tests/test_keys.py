"""API keys as events: created by the CLI, folded by every router, used, revoked, and their usage in DuckDB."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import msgspec
import openai
import pytest
from streams import stored
from test_cli_models import invoke
from test_router import place

from llmgw import ctl, subjects
from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.engine.fake import spawn
from llmgw.projections.runner import Projector
from llmgw.projections.store import Store
from llmgw.router.server import Router


def declared(name: str, **kw: object) -> tuple[str, m.KeyDeclared]:
    secret, key_id, salt, digest = ctl.new_key_secret()
    return secret, m.KeyDeclared(at=m.utcnow(), name=name, lookup_id=key_id, salt=salt, digest=digest, **kw)  # type: ignore[arg-type]


@pytest.fixture
async def served(bus: Bus) -> AsyncIterator[tuple[Router, Router]]:
    """Two routers in front of one fake engine of model ``k``."""
    engine = spawn("k", name="E")
    routers = [Router(bus, f"rt-{i}", tick_s=3600) for i in range(2)]
    try:
        await place(bus, "E", "k", engine.url)
        for r in routers:
            await r.start("127.0.0.1", 0)
            await r.sink.wait_for(lambda p: bool(p.healthy.get("k")))
        yield routers[0], routers[1]
    finally:
        for r in routers:
            await r.stop()
        engine.stop()


async def ask(router: Router, key: str | None, model: str = "k") -> int:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    body = {"model": model, "messages": [{"role": "user", "content": "hello there"}]}
    async with aiohttp.ClientSession() as http, http.post(router.url + "/v1/chat/completions", json=body,
                                                          headers=headers) as r:
        return r.status


async def until_status(router: Router, key: str | None, want: int, within_s: float = 10.0) -> float:
    t0 = time.monotonic()
    while (got := await ask(router, key)) != want:
        assert time.monotonic() - t0 < within_s, f"{router.name} still answers {got}, not {want}"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def test_a_declared_key_is_taken_by_every_router_and_a_revoked_one_refused_by_all(
    bus: Bus, served: tuple[Router, Router]
) -> None:
    a, b = served
    assert await ask(a, None) == 200  # no key anywhere yet: anonymous, as before
    secret, key = declared("team-a", tenant="a")
    await bus.publish(key)
    for r in (a, b):
        await until_status(r, secret, 200)
    assert await ask(a, None) == 401  # a key exists: every request needs one
    assert await ask(a, "sk-something-else") == 401
    wrong = secret[:-4] + ("AAAA" if not secret.endswith("AAAA") else "BBBB")
    assert await ask(a, wrong) == 401  # its id, another secret
    assert await ask(a, m.KEY_PREFIX + "0" * 16 + "-" + "x" * 43) == 401  # an id nobody has
    assert await ask(a, m.KEY_PREFIX + "zz" * 700) == 401  # garbage, long, no id
    client = openai.AsyncOpenAI(base_url=b.url + "/v1", api_key=secret, max_retries=0, timeout=20)
    try:
        reply = await client.chat.completions.create(model="k", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content
    finally:
        await client.close()
    await bus.publish(m.KeyRevoked(at=m.utcnow(), name="team-a"))
    seen = [await until_status(r, secret, 401) for r in (a, b)]
    print(f"revocation seen by the two routers after {seen[0]:.2f} s and {seen[1]:.2f} s")  # a figure (-s)


async def test_a_key_for_some_models_is_refused_the_others_and_an_expired_one_everything(
    bus: Bus, served: tuple[Router, Router]
) -> None:
    a, _ = served
    only, key = declared("only-x", models=("x",))
    await bus.publish(key)
    await a.sink.wait_for(lambda p: True)
    await until_status(a, only, 403)
    gone, old = declared("gone", expires_at=m.utcnow())
    await bus.publish(old)
    await until_status(a, gone, 401)


async def test_what_each_key_asked_reaches_duckdb(bus: Bus, served: tuple[Router, Router], tmp_path: Path) -> None:
    a, b = served
    s1, k1 = declared("team-a", tenant="alpha")
    s2, k2 = declared("team-b", tenant="beta")
    await bus.publish(k1)
    await bus.publish(k2)
    await until_status(a, s1, 200)
    await until_status(b, s2, 200)
    for _ in range(3):
        assert await ask(a, s1) == 200
    assert await ask(b, s1) == 200
    assert await ask(b, s2) == 200
    sent = {"team-a": a._key_use["team-a"]["k"].requests + b._key_use["team-a"]["k"].requests,
            "team-b": b._key_use["team-b"]["k"].requests}
    prompt = b._key_use["team-b"]["k"].prompt
    assert sent == {"team-a": 5, "team-b": 2}  # counting the until_status requests too
    for r in (a, b):
        await r.publish_idle_map()
    assert not a._key_use and not b._key_use  # taken once
    store = Store(tmp_path / "llmgw.duckdb")
    projector = Projector(bus, store)
    await projector.run_once()
    try:
        rows = dict(store.query("SELECT key_name, sum(requests)::INTEGER FROM usage_by_key GROUP BY 1"))
        assert rows == sent
        daily = store.query("SELECT tenant, requests::INTEGER, prompt_tokens::INTEGER FROM usage_by_key_daily "
                            "WHERE key_name = 'team-b'")
        assert daily == [("beta", 2, prompt)] and prompt > 0  # the engine's usage, summed
    finally:
        store.close()


async def test_keys_from_the_cli_print_the_secret_once_and_store_only_its_digest(bus: Bus, nats_url: str) -> None:
    r = await invoke(nats_url, "ctl", "key", "create", "ci", "--tenant", "team-a", "--models", "k,other",
                     "--requests-per-minute", "600", "--expires", "30d", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    secret = out["secret"]
    assert secret.startswith(m.KEY_PREFIX) and len(secret) > 50
    (event,) = [e for e in await stored(bus, subjects.STREAM_CONTROL) if isinstance(e, m.KeyDeclared)]
    raw = msgspec.json.encode(event)
    assert secret.encode() not in raw and event.digest == ctl.key_digest(event.salt, secret)
    assert (event.tenant, event.models, event.requests_per_minute) == ("team-a", ("k", "other"), 600)
    listed = json.loads((await invoke(nats_url, "ctl", "key", "list", "--json")).output)
    assert [k["name"] for k in listed] == ["ci"] and "digest" not in listed[0] and "salt" not in listed[0]
    again = await invoke(nats_url, "ctl", "key", "create", "ci")
    assert again.exit_code == 1 and "a key named 'ci' exists" in again.output
    updated = await invoke(nats_url, "ctl", "key", "update", "ci", "--tokens-per-day", "2000000")
    assert updated.exit_code == 0, updated.output
    shown = json.loads((await invoke(nats_url, "ctl", "key", "show", "ci", "--json")).output)
    assert shown["tokens_per_day"] == 2_000_000 and shown["lookup_id"] == event.lookup_id  # same secret
    assert (await invoke(nats_url, "ctl", "key", "revoke", "ci")).exit_code == 0
    assert json.loads((await invoke(nats_url, "ctl", "key", "list", "--json")).output) == []
    gone = await invoke(nats_url, "ctl", "key", "revoke", "ci")
    assert gone.exit_code == 1 and "no key named 'ci'" in gone.output


@pytest.mark.parametrize("limit", ["0", "-5", str(10**16)])
async def test_limits_out_of_bounds_are_refused_and_publish_nothing(bus: Bus, nats_url: str, limit: str) -> None:
    r = await invoke(nats_url, "ctl", "key", "create", "x", "--tokens-per-day", limit)
    assert r.exit_code == 2 and "Error: Invalid value for '--tokens-per-day'" in r.output
    assert await stored(bus, subjects.STREAM_CONTROL) == []


async def test_over_its_limits_a_key_gets_429_that_the_openai_client_raises(bus: Bus,
                                                                          served: tuple[Router, Router]) -> None:
    a, _ = served
    rpm, k1 = declared("per-minute", requests_per_minute=2)
    tpd, k2 = declared("per-day", tokens_per_day=5)
    await bus.publish(k1)
    await bus.publish(k2)
    await until_status(a, rpm, 200)  # the first of its two
    assert await ask(a, rpm) == 200
    client = openai.AsyncOpenAI(base_url=a.url + "/v1", api_key=rpm, max_retries=0, timeout=20)
    try:
        with pytest.raises(openai.RateLimitError) as err:
            await client.chat.completions.create(model="k", messages=[{"role": "user", "content": "hi"}])
        assert err.value.code == "rate_limit_exceeded"
        assert 1 <= int(err.value.response.headers["Retry-After"]) <= 60
    finally:
        await client.close()
    await until_status(a, tpd, 200)  # its answer's tokens (the fake engine's usage) pass 5 for today
    client = openai.AsyncOpenAI(base_url=a.url + "/v1", api_key=tpd, max_retries=0, timeout=20)
    try:
        with pytest.raises(openai.RateLimitError) as err:
            await client.chat.completions.create(model="k", messages=[{"role": "user", "content": "hi"}])
        assert err.value.code == "insufficient_quota"
        assert int(err.value.response.headers["Retry-After"]) <= 86_400
    finally:
        await client.close()
    assert a.metrics.errors("", "rate_limited") == 1 and a.metrics.errors("", "quota_exceeded") == 1


async def test_two_routers_share_one_quota(bus: Bus, served: tuple[Router, Router]) -> None:
    """What a key asked through one router counts at the other once its map is out: not twice the quota."""
    a, b = served
    secret, key = declared("shared", requests_per_minute=4)
    await bus.publish(key)
    await until_status(a, secret, 200)
    assert await ask(a, secret) == 200
    await a.publish_idle_map()  # its tick: the other router reads what the key asked here
    for _ in range(100):
        counts = b.quotas.counts.get("shared")
        if counts is not None and counts.requests(time.time())[0] == 2:
            break
        await asyncio.sleep(0.05)
    assert [await ask(b, secret) for _ in range(3)] == [200, 200, 429]  # 2 there + 2 here = 4 a minute


def test_the_chargeback_splits_each_models_gpu_hours_by_its_tenants_tokens(tmp_path: Path) -> None:
    """Two tenants' tokens on one model, a day of a 2-GPU replica: their GPU-hours sum to the model's."""
    from analyst_history import project
    from projection_events import inventory, placed, spec, t

    qwen = spec("qwen-8b", tp=2)
    _, alpha = declared("ka", tenant="alpha")
    _, beta = declared("kb", tenant="beta")
    use = {"ka": {"qwen-8b": m.KeyUse(requests=3, prompt_tokens=300, completion_tokens=0)},
           "kb": {"qwen-8b": m.KeyUse(requests=1, prompt_tokens=100, completion_tokens=0)}}
    events: list[m.Event] = [inventory("n1", "ib-a", 4, t(0)), m.ModelDeclared(at=t(0), spec=qwen),
                             placed("r-q", qwen, [("n1", 0), ("n1", 1)], t(0)),
                             msgspec.structs.replace(alpha, at=t(0)), msgspec.structs.replace(beta, at=t(0)),
                             m.IdleMapPublished(at=t(30), router="rt", boot_id="b", tick=1, callers=use),
                             m.ReplicaStopped(at=t(60), replica_id="r-q", model="qwen-8b", reason="idle", code="idle")]
    store = project(tmp_path / "llmgw.duckdb", events)
    try:
        rows = store.query("SELECT tenant, round(token_share, 2), round(gpu_hours, 3) FROM chargeback_daily "
                           "ORDER BY tenant")
        assert rows == [("alpha", 0.75, 1.5), ("beta", 0.25, 0.5)]  # 2 GPUs × 1 h, split 3:1
    finally:
        store.close()


def test_ctl_usage_answers_per_tenant_key_and_model(tmp_path: Path) -> None:
    from analyst_history import project
    from click.testing import CliRunner
    from projection_events import t

    from llmgw.cli.main import cli

    _, alpha = declared("ka", tenant="alpha")
    use = {"ka": {"m1": m.KeyUse(requests=3, errors=1, prompt_tokens=300, completion_tokens=30, cached_tokens=200)}}
    now = m.utcnow()
    project(tmp_path / "llmgw.duckdb", [msgspec.structs.replace(alpha, at=t(0)),
                                        m.IdleMapPublished(at=now, router="rt", boot_id="b", tick=1, callers=use)]).close()
    # No projector answers there (nothing listens on port 1): the file.
    r = CliRunner().invoke(cli, ["ctl", "usage", "--by", "tenant", "--json", "--data-dir", str(tmp_path),
                                 "--nats-url", "nats://127.0.0.1:1"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == [{"tenant": "alpha", "requests": 3, "errors": 1, "throttled": 0, "forbidden": 0,
                                     "prompt_tokens": 300, "completion_tokens": 30, "cached_tokens": 200}]
    table = CliRunner().invoke(cli, ["ctl", "usage", "--by", "key", "--db", str(tmp_path / "llmgw.duckdb")])
    assert table.exit_code == 0 and "ka" in table.output and "300" in table.output
    missing = CliRunner().invoke(cli, ["ctl", "usage", "--db", str(tmp_path / "nope.duckdb")])
    assert missing.exit_code == 1 and missing.output.startswith("Error: no projection at")


async def test_at_capacity_high_goes_first_and_low_is_shed_first(bus: Bus) -> None:
    """One replica of one slot, busy: a high-priority request overtakes a normal one, and takes the place
    of a low one in a full queue (that one hears 429 at once)."""
    engine = spawn("one", "--latency-ms", "400", name="S")
    router = Router(bus, "rt-prio", tick_s=3600)
    try:
        spec = m.ModelSpec(name="one", source="x", precision="q8_0", engine="llama.cpp", gpu_class="CPU",
                           context=2048, parallel=1)  # one slot: llama.cpp's -np 1
        await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec))
        await place(bus, "S", "one", engine.url)
        await router.start("127.0.0.1", 0)
        await router.sink.wait_for(lambda p: bool(p.healthy.get("one")) and "one" in p.declared)
        keys = {}
        for name, priority in (("hi", "high"), ("mid", "normal"), ("lo", "low")):
            secret, key = declared(name, priority=priority)
            await bus.publish(key)
            keys[name] = secret
        await until_status_model(router, keys["mid"], "one")
        order: list[str] = []

        async def send(name: str) -> int:
            status = await ask(router, keys[name], "one")
            order.append(name)
            return status

        first = asyncio.create_task(send("mid"))  # takes the slot
        await asyncio.sleep(0.1)
        queued_mid = asyncio.create_task(send("mid"))
        await asyncio.sleep(0.05)
        queued_lo = asyncio.create_task(send("lo"))
        await asyncio.sleep(0.05)  # the queue holds two (2 per slot): full
        high = asyncio.create_task(send("hi"))
        assert await queued_lo == 429  # shed for the high one, at once
        assert [await first, await high, await queued_mid] == [200, 200, 200]
        assert order == ["lo", "mid", "hi", "mid"]  # after the first: high before the normal that waited longer
        assert router.metrics.errors("one", "shed") == 1
    finally:
        await router.stop()
        engine.stop()


async def until_status_model(router: Router, key: str, model: str) -> None:
    for _ in range(200):
        if await ask(router, key, model) == 200:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the key never worked")


def test_status_sums_each_tenants_use_and_names_the_keys_near_their_limit() -> None:
    """Today and seven days per tenant, from the routers' maps as the fold keeps them; the dashboard shows it."""
    from datetime import timedelta

    from llmgw.dashboard.page import tenants_section
    from llmgw.fleet.state import fold
    from llmgw.fleet.status import report

    now = m.utcnow()
    _, ka = declared("ka", tenant="alpha", tokens_per_day=1000)
    _, kb = declared("kb", tenant="beta")

    def tick(at: object, key: str, requests: int, tokens: int) -> m.IdleMapPublished:
        use = {key: {"m": m.KeyUse(requests=requests, prompt_tokens=tokens)}}
        return m.IdleMapPublished(at=at, router="rt", boot_id="b", tick=1, callers=use)  # type: ignore[arg-type]

    state = fold([msgspec.structs.replace(ka, at=now - timedelta(days=10)),
                  msgspec.structs.replace(kb, at=now - timedelta(days=10)),
                  tick(now - timedelta(days=9), "ka", 50, 5000),  # past the window: dropped
                  tick(now - timedelta(days=3), "ka", 2, 200),
                  tick(now - timedelta(days=3), "kb", 1, 10),
                  tick(now, "ka", 3, 850)])
    r = report(state, now)
    assert [(t.tenant, t.requests_today, t.tokens_today, t.requests_7d, t.tokens_7d) for t in r.tenants] == [
        ("alpha", 3, 850, 5, 1050), ("beta", 0, 0, 1, 10)]
    assert [(k.name, k.tokens_today, k.tokens_per_day) for k in r.near_limits] == [("ka", 850, 1000)]
    html = str(tenants_section(r))
    assert "alpha" in html and "5 req · 1,050 tok" in html and "ka (alpha): 850 of 1,000 tokens today" in html


async def test_a_router_restarting_mid_minute_keeps_the_window(bus: Bus, served: tuple[Router, Router]) -> None:
    """Its last map, read back at start, still counts: a restart is no way around a rate limit."""
    a, _ = served
    secret, key = declared("restart", requests_per_minute=3)
    await bus.publish(key)
    await until_status(a, secret, 200)
    assert await ask(a, secret) == 200
    again = Router(bus, "rt-restart-quota", tick_s=3600)
    await again.start("127.0.0.1", 0)
    try:
        assert await ask(again, secret) == 200  # one of a different name: it sees a's two only once a's map is out
    finally:
        await again.stop()  # its final map: one request
    second = Router(bus, "rt-restart-quota", tick_s=3600)  # the same router, restarted
    await second.start("127.0.0.1", 0)
    try:
        for _ in range(100):
            counts = second.quotas.counts.get("restart")
            if counts is not None and counts.requests(time.time())[0] >= 1:
                break
            await asyncio.sleep(0.05)
        await a.publish_idle_map()  # and a's two
        for _ in range(100):
            if second.quotas.counts["restart"].requests(time.time())[0] == 3:
                break
            await asyncio.sleep(0.05)
        assert await ask(second, secret) == 429  # 2 + 1 before the restart: the minute is full
    finally:
        await second.stop()


async def test_six_normal_clients_on_a_one_slot_model_queue_and_none_is_shed(bus: Bus) -> None:
    """Issue 43 #7: six concurrent normal clients on one slot got thousands of 429s saying "this priority is
    shed first"; normal requests wait their turn, and only past the queue's bound hear it is full."""
    engine = spawn("one", "--latency-ms", "50", name="S6")
    router = Router(bus, "rt-six", tick_s=3600)
    try:
        spec = m.ModelSpec(name="one", source="x", precision="q8_0", engine="llama.cpp", gpu_class="CPU",
                           context=2048, parallel=1)
        await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec))
        await place(bus, "S6", "one", engine.url)
        await router.start("127.0.0.1", 0)
        await router.sink.wait_for(lambda p: bool(p.healthy.get("one")) and "one" in p.declared)

        async def client() -> list[int]:
            return [await ask(router, None, "one") for _ in range(3)]

        statuses = [s for got in await asyncio.gather(*(client() for _ in range(6))) for s in got]
        assert statuses == [200] * 18
        assert router.metrics.errors("one", "shed") == 0
    finally:
        await router.stop()
        engine.stop()


async def test_keys_imported_from_a_file_are_one_batch_every_router_takes(
    bus: Bus, nats_url: str, served: tuple[Router, Router], tmp_path: Path
) -> None:
    f = tmp_path / "keys.toml"
    f.write_text("".join(f'[[key]]\nname = "k{i}"\ntenant = "t{i % 3}"\nrequests_per_minute = 600\n'
                         'expires = "30d"\n\n' for i in range(300)))
    r = await invoke(nats_url, "ctl", "key", "import", str(f))
    assert r.exit_code == 0, r.output
    lines = [line.split("\t") for line in r.stdout.splitlines()]
    assert [name for name, _ in lines] == [f"k{i}" for i in range(300)]
    keys = [e for e in await stored(bus, subjects.STREAM_CONTROL) if isinstance(e, m.KeyDeclared)]
    assert [k.name for k in keys] == [f"k{i}" for i in range(300)] and keys[7].tenant == "t1"
    secrets = dict(lines)
    assert all(k.digest == ctl.key_digest(k.salt, secrets[k.name]) for k in keys)
    assert not any(s.encode() in msgspec.json.encode(k) for k, s in zip(keys, secrets.values(), strict=True))
    for router in served:
        await until_status(router, secrets["k299"], 200)
    # A name that exists, a bad entry: nothing at all is imported.
    f.write_text('[[key]]\nname = "new"\n\n[[key]]\nname = "k5"\n')
    again = await invoke(nats_url, "ctl", "key", "import", str(f))
    assert again.exit_code == 1 and "1 key name exists already (k5)" in again.output and "nothing was imported" in again.output
    f.write_text('[[key]]\nname = "new"\n\n[[key]]\nname = "x"\nrequests_per_minute = 0\n')
    bad = await invoke(nats_url, "ctl", "key", "import", str(f))
    assert bad.exit_code == 1 and "key[1]" in bad.output and "requests_per_minute" in bad.output
    f.write_text("[[key]]\nname = \"../etc\"\n")
    named = await invoke(nats_url, "ctl", "key", "import", str(f))
    assert named.exit_code == 1 and "key[0]" in named.output
    assert len([e for e in await stored(bus, subjects.STREAM_CONTROL) if isinstance(e, m.KeyDeclared)]) == 300
