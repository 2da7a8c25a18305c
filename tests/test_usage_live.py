"""What ``ctl usage`` answers (issue 43 #6): anonymous traffic counted as the anonymous caller's, 429s and
403s apart from other errors, the analysts' copy's age, and live figures from the status service."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
from click.testing import CliRunner
from live_projector import publish_fresh, serving
from test_keys import ask, declared, until_status_model
from test_router import place

from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.config import Settings
from llmgw.engine.fake import spawn
from llmgw.messages.usage import ANONYMOUS_CALLER
from llmgw.router.server import Router


async def test_anonymous_requests_are_the_anonymous_callers_in_the_routers_map(bus: Bus) -> None:
    engine = spawn("k", name="A")
    router = Router(bus, "rt-anon", tick_s=3600)
    try:
        await place(bus, "A", "k", engine.url)
        await router.start("127.0.0.1", 0)
        await router.sink.wait_for(lambda p: bool(p.healthy.get("k")))
        assert [await ask(router, None, "k") for _ in range(2)] == [200, 200]
        use = (await router.publish_idle_map()).callers[ANONYMOUS_CALLER]["k"]
        assert use.requests == 2 and use.prompt_tokens > 0 and use.errors == 0
    finally:
        await router.stop()
        engine.stop()


async def test_429s_and_403s_are_counted_apart_from_other_errors(bus: Bus) -> None:
    engine = spawn("k", name="B")
    router = Router(bus, "rt-errs", tick_s=3600)
    try:
        await place(bus, "B", "k", engine.url)
        await router.start("127.0.0.1", 0)
        await router.sink.wait_for(lambda p: bool(p.healthy.get("k")))
        slow, slow_key = declared("slow", requests_per_minute=1)
        narrow, narrow_key = declared("narrow", models=("other",))
        await bus.publish(slow_key)
        await bus.publish(narrow_key)
        await until_status_model(router, slow, "k")  # its one request this minute
        assert await ask(router, slow, "k") == 429
        assert await ask(router, narrow, "k") == 403
        callers = (await router.publish_idle_map()).callers
        s, n = callers["slow"]["k"], callers["narrow"]["k"]
        assert (s.requests, s.errors, s.throttled, s.forbidden) == (2, 1, 1, 0)
        assert (n.requests, n.errors, n.throttled, n.forbidden) == (1, 1, 0, 1)
    finally:
        await router.stop()
        engine.stop()


def usage_events() -> list[m.Event]:
    _, alpha = declared("ka", tenant="alpha")
    now = m.utcnow()
    use = {"ka": {"m1": m.KeyUse(requests=3, errors=1, throttled=1, prompt_tokens=300, completion_tokens=30)},
           ANONYMOUS_CALLER: {"m1": m.KeyUse(requests=5, prompt_tokens=50, completion_tokens=50)}}
    return [msgspec.structs.replace(alpha, at=now),
            m.IdleMapPublished(at=now, router="rt", boot_id="b", tick=1, callers=use)]


def usage(settings: Settings, *args: str) -> tuple[int, str]:
    r = CliRunner().invoke(cli, ["ctl", "usage", *args, "--nats-url", settings.nats_url])
    return r.exit_code, r.output


def test_usage_live_asks_the_status_service_and_counts_anonymous_traffic(settings: Settings, tmp_path: Path) -> None:
    events = usage_events()
    asyncio.run(publish_fresh(settings, events))
    with serving(settings, tmp_path / "live.duckdb", len(events)):
        code, out = usage(settings, "--live", "--json")
        assert code == 0, out
        assert json.loads(out) == [
            {"tenant": "alpha", "requests_today": 3, "tokens_today": 330, "requests_7d": 3, "tokens_7d": 330},
            {"tenant": "", "requests_today": 5, "tokens_today": 100, "requests_7d": 5, "tokens_7d": 100}]
        code, table = usage(settings, "--live")
        assert code == 0 and table.startswith("live, from the status service (as of "), table
    code, keys = usage(settings, "--live", "--by", "key")
    assert code == 0, keys
    lines = keys.splitlines()
    assert lines[0].startswith("live, from the control and usage streams, folded here (as of ")
    assert lines[2].split() == ["ka", "3", "330", "3", "330"]
    assert lines[3].split() == ["(anonymous)", "5", "100", "5", "100"]
    code, err = usage(settings, "--live", "--by", "model")
    assert code == 1 and err.startswith("Error: --live answers --by tenant or --by key"), err


def test_usage_from_the_analysts_copy_says_how_old_it_is(tmp_path: Path) -> None:
    from analyst_history import project
    from test_export import held

    db = tmp_path / "llmgw.duckdb"
    project(db, usage_events()).close()
    project(tmp_path / "other.duckdb", usage_events()).export_copy(tmp_path / "llmgw.analysts.duckdb")
    with held(db):
        r = CliRunner().invoke(cli, ["ctl", "usage", "--by", "model", "--db", str(db)])
    assert r.exit_code == 0, r.output
    assert r.stderr.startswith(f"{db} is held by a running projector: read its analysts' copy "
                               f"{tmp_path / 'llmgw.analysts.duckdb'} (written "), r.stderr
    assert " ago; leave --db out to ask the projector for the figures up to now)" in r.stderr
    # The anonymous caller's requests are the model's too; of the errors, one 429.
    assert r.stdout.splitlines()[0].split() == ["model", "requests", "errors", "429", "403", "prompt", "completion",
                                                "cached"]
    assert r.stdout.splitlines()[1].split() == ["m1", "8", "1", "1", "0", "350", "80", "0"]


def test_usage_right_after_traffic_is_the_running_projectors_own(settings: Settings, tmp_path: Path) -> None:
    """Issue 43 #6: with a projector holding the file and no copy yet, `ctl usage` answered nothing useful;
    the projector answers from its file once it has committed what was stored when asked."""
    events = usage_events()
    asyncio.run(publish_fresh(settings, events))
    db = tmp_path / "llmgw.duckdb"
    with serving(settings, db, len(events), commit_interval_s=3600, writer_process=True):
        r = CliRunner().invoke(cli, ["ctl", "usage", "--by", "model", "--json", "--data-dir", str(tmp_path),
                                     "--nats-url", settings.nats_url])
        assert r.exit_code == 0, r.output
        assert r.stderr.startswith("from the running projector (events up to "), r.stderr
        assert json.loads(r.stdout) == [
            {"model": "m1", "requests": 8, "errors": 1, "throttled": 1, "forbidden": 0, "prompt_tokens": 350,
             "completion_tokens": 80, "cached_tokens": 0}]
        r = CliRunner().invoke(cli, ["ctl", "usage", "--by", "key", "--nats-url", settings.nats_url])
        assert r.exit_code == 0, r.output
        assert [x.split() for x in r.stdout.splitlines()[1:]] == [
            ["ka", "3", "1", "1", "0", "300", "30", "0"], ["(anonymous)", "5", "0", "0", "0", "50", "50", "0"]]
    # No projector: the file, and why.
    r = CliRunner().invoke(cli, ["ctl", "usage", "--by", "tenant", "--json", "--data-dir", str(tmp_path),
                                 "--nats-url", settings.nats_url])
    assert r.exit_code == 0, r.output
    assert r.stderr == f"no projector is running: reading {db}\n"
    assert [(x["tenant"], x["requests"], x["throttled"]) for x in json.loads(r.stdout)] == [("alpha", 3, 1), ("", 5, 0)]


def test_anonymous_tokens_take_their_share_of_the_chargeback(tmp_path: Path) -> None:
    """The anonymous caller's tokens are the tenant '' (none) in chargeback_daily: alpha pays 3/4, not all."""
    from analyst_history import project
    from projection_events import inventory, placed, spec, t

    qwen = spec("qwen-8b", tp=2)
    _, alpha = declared("ka", tenant="alpha")
    use = {"ka": {"qwen-8b": m.KeyUse(requests=3, prompt_tokens=300)},
           ANONYMOUS_CALLER: {"qwen-8b": m.KeyUse(requests=1, prompt_tokens=100)}}
    events: list[m.Event] = [inventory("n1", "ib-a", 2, t(0)), m.ModelDeclared(at=t(0), spec=qwen),
                             placed("r-q", qwen, [("n1", 0), ("n1", 1)], t(0)), msgspec.structs.replace(alpha, at=t(0)),
                             m.IdleMapPublished(at=t(30), router="rt", boot_id="b", tick=1, callers=use),
                             m.ReplicaStopped(at=t(60), replica_id="r-q", model="qwen-8b", reason="idle", code="idle")]
    store = project(tmp_path / "llmgw.duckdb", events)
    try:
        assert store.query("SELECT tenant, round(token_share, 2), round(gpu_hours, 3) FROM chargeback_daily "
                           "ORDER BY tenant") == [("", 0.25, 0.5), ("alpha", 0.75, 1.5)]
    finally:
        store.close()
