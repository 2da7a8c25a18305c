"""One request you can trace: its id in every answer and to the engine, its access-log line, ``ctl request``.

A router with ``--access-log`` in front of one fake engine process, on the session's nats-server.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import re
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from click.testing import CliRunner
from running import engines as running_engines
from test_router import in_pool, place
from test_router_bodies import POST, raw

from llmgw import messages as m
from llmgw.apikeys import hash_key
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.cli.up import access_log_arg
from llmgw.engine.fake import EngineProcess
from llmgw.errors import ConfigError
from llmgw.router.access import AccessLog
from llmgw.router.server import Router

MODEL = "trace-model"
CHAT = "/v1/chat/completions"
HEX32 = re.compile(r"^[0-9a-f]{32}$")


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineProcess]:
    with running_engines(T=(MODEL,)) as procs:
        yield procs["T"]


async def started(bus: Bus, engine: EngineProcess, log: Path | str, **kwargs: Any) -> Router:
    r = Router(bus, "router-trace", tick_s=3600, access_log=str(log), **kwargs)
    await r.start("127.0.0.1", 0)
    await place(bus, "T", MODEL, engine.url)
    await r.sink.wait_for(in_pool("T"))
    return r


@pytest.fixture
async def router(bus: Bus, engine: EngineProcess, tmp_path: Path) -> AsyncIterator[Router]:
    r = await started(bus, engine, tmp_path / "access.log")
    try:
        yield r
    finally:
        await r.stop()


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def rotate(path: Path) -> Path:
    """What logrotate does first: move the file away (the router still holds it open)."""
    return path.rename(path.with_suffix(".log.1"))


async def lines(router: Router) -> list[dict[str, Any]]:
    assert router.access_log is not None
    await router.access_log.flush()
    return read(Path(router.access_log.path))


async def engine_ids(engine: EngineProcess) -> list[str]:
    async with aiohttp.ClientSession() as s, s.get(engine.url + "/stats") as resp:
        ids: list[str] = (await resp.json())["request_ids"]
        return ids


async def test_every_answer_carries_its_id_and_the_line_says_what_happened(
        router: Router, engine: EngineProcess) -> None:
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="-", max_retries=0, timeout=20) as client:
        # The client's own id is kept, answered, and sent on to the engine.
        reply = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_headers={"X-Request-Id": "trace-1"})
        assert reply.headers["x-request-id"] == "trace-1"
        done = reply.parse()
        assert done.usage is not None
        assert (await engine_ids(engine))[-1] == "trace-1"
        # None sent: a new one; a stream's head carries it too.
        async with client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
                stream_options={"include_usage": True}) as streamed:
            new = streamed.headers["x-request-id"]
            assert HEX32.match(new)
            assert [c async for c in streamed.iter_lines() if c]
        assert (await engine_ids(engine))[-1] == new
    # An id that could break a header or a log line is replaced, never passed on.
    async with aiohttp.ClientSession() as s:
        for bad in ("x" * 129, "has space", 'quo"te', "ünï"):
            async with s.post(router.url + CHAT, json={"model": MODEL, "messages": []},
                              headers={"X-Request-Id": bad}) as resp:
                assert resp.status == 200 and HEX32.match(resp.headers["x-request-id"]), bad
        # An error's body says it as well; /health and a route the router does not serve carry it.
        async with s.post(router.url + CHAT, json={"model": "nope"}, headers={"X-Request-Id": "trace-404"}) as resp:
            assert resp.status == 404 and resp.headers["x-request-id"] == "trace-404"
            assert (await resp.json())["error"] == {
                "message": "the model `nope` does not exist; GET /v1/models lists the models served",
                "type": "invalid_request_error", "param": "model", "code": "model_not_found",
                "request_id": "trace-404"}
        for path in ("/health", "/nowhere"):
            async with s.get(router.url + path) as resp:
                assert HEX32.match(resp.headers["x-request-id"]), path
    # A request aiohttp's parser refused, before any route ran.
    status, headers, body = await raw(router, POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n")
    assert status == 400 and HEX32.match(headers["x-request-id"])
    assert json.loads(body)["error"]["request_id"] == headers["x-request-id"]

    got = {x["id"]: x for x in await lines(router)}
    assert len(got) == 7, got  # the two answered, the four with a bad id, the 404; not /health nor /nowhere
    one = got["trace-1"]
    assert {k: one[k] for k in ("router", "route", "caller", "model", "replica", "status", "stream", "error",
                                "prompt_tokens", "completion_tokens", "cached_tokens")} == {
        "router": "router-trace", "route": CHAT, "caller": "-", "model": MODEL, "replica": "T", "status": 200,
        "stream": False, "error": "", "prompt_tokens": done.usage.prompt_tokens,
        "completion_tokens": done.usage.completion_tokens, "cached_tokens": 0}
    assert one["ttft_ms"] >= 0 and one["total_ms"] >= one["ttft_ms"] and one["queue_ms"] >= 0
    assert one["at"].endswith("Z") or "+00:00" in one["at"]
    s2 = got[new]
    assert s2["stream"] is True and s2["status"] == 200 and s2["prompt_tokens"] > 0 and s2["completion_tokens"] > 0
    assert s2["ttft_ms"] >= 0
    lost = got["trace-404"]
    assert (lost["status"], lost["model"], lost["replica"], lost["error"], lost["ttft_ms"]) == (
        404, "nope", "", "model_not_found", -1)


async def test_a_key_is_named_by_its_digest_never_its_secret(bus: Bus, engine: EngineProcess, tmp_path: Path) -> None:
    secret = "sk-trace-secret-123456"
    r = await started(bus, engine, tmp_path / "a.log", api_keys=[hash_key(secret)])
    try:
        async with aiohttp.ClientSession() as s:
            for token in (secret, "wrong"):
                async with s.post(r.url + CHAT, json={"model": MODEL, "messages": []},
                                  headers={"Authorization": f"Bearer {token}"}) as resp:
                    assert resp.status == (200 if token == secret else 401)
        got = await lines(r)
    finally:
        await r.stop()
    assert [(x["caller"], x["status"], x["error"]) for x in got] == [
        ("sha256:" + hash_key(secret)[:12], 200, ""), ("-", 401, "invalid_api_key")]
    text = (tmp_path / "a.log").read_text()
    assert secret not in text and "wrong" not in text and hash_key(secret) not in text


async def test_sigusr1_reopens_the_log_after_logrotate_moved_it(router: Router) -> None:
    async def ask(rid: str) -> None:
        async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, json={"model": MODEL, "messages": []},
                                                        headers={"X-Request-Id": rid}) as resp:
            assert resp.status == 200

    assert router.access_log is not None
    log = Path(router.access_log.path)
    await ask("before")
    await router.access_log.flush()
    moved = rotate(log)
    await ask("moved")  # still written to the file it had open: the one logrotate renamed
    router.access_log.reopen()
    await ask("after")
    await router.access_log.flush()
    assert [x["id"] for x in read(moved)] == ["before", "moved"]
    assert [x["id"] for x in read(log)] == ["after"]


async def test_a_client_that_leaves_is_a_499_line_naming_the_replica(bus: Bus, tmp_path: Path) -> None:
    with running_engines(SLOW=("slow-model", "--latency-ms", "5000")) as procs:
        r = Router(bus, "router-trace-gone", tick_s=3600, access_log=str(tmp_path / "gone.log"))
        await r.start("127.0.0.1", 0)
        try:
            await place(bus, "SLOW", "slow-model", procs["SLOW"].url)
            await r.sink.wait_for(in_pool("SLOW"))
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as s:
                with pytest.raises(TimeoutError):
                    async with s.post(r.url + CHAT, json={"model": "slow-model", "messages": []},
                                      headers={"X-Request-Id": "gone-1"}):
                        pass
            for _ in range(100):  # the router's handler is cancelled once it sees the socket close
                if got := await lines(r):
                    break
                await asyncio.sleep(0.05)
        finally:
            await r.stop()
    assert [(x["id"], x["status"], x["replica"], x["ttft_ms"]) for x in got] == [("gone-1", 499, "SLOW", -1)]


def line(rid: str) -> m.AccessLine:
    return m.AccessLine(at=datetime.now(UTC), id=rid, model=MODEL, status=200)


async def test_a_disk_that_does_not_keep_up_drops_lines_and_counts_them(
        router: Router, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # No writer thread: nothing is taken off the queue, as when the disk stalls. The request never waits.
    stalled = AccessLog(str(tmp_path / "stalled.log"), max_pending=2)
    for i in range(5):
        stalled.write(line(f"r{i}"))
    assert stalled.dropped == 3
    # The router's own: its drops are a metric, and the writer says so in the router's log.
    assert router.access_log is not None
    router.access_log.dropped = 4
    router.access_log.write(line("after-a-stall"))
    await router.access_log.flush()
    async with aiohttp.ClientSession() as s, s.get(router.url + "/metrics") as resp:
        assert "llmgw_router_access_log_dropped_total 4.0" in (await resp.text()).splitlines()
    assert [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()] == [
        f"access log {router.access_log.path}: 4 lines dropped so far (the disk did not keep up, or refused them)"]


async def test_dash_writes_the_lines_to_standard_output(capsys: pytest.CaptureFixture[str]) -> None:
    out = AccessLog("-")
    out.open()
    out.write(line("to-stdout"))
    await out.close()
    (shown,) = capsys.readouterr().out.splitlines()
    assert json.loads(shown)["id"] == "to-stdout"


async def test_an_access_log_it_cannot_write_is_refused_at_start(bus: Bus, tmp_path: Path) -> None:
    r = Router(bus, "router-trace-bad", tick_s=3600, access_log=str(tmp_path / "no" / "such" / "dir.log"))
    with pytest.raises(ConfigError, match=r"cannot open the access log .*dir\.log \(No such file or directory\); "
                                          r"give --access-log a file"):
        await r.start("127.0.0.1", 0)
    await r.stop()


def test_cli_router_with_an_access_log_it_cannot_open(nats_url: str, tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["router", "--listen", "127.0.0.1:0", "--nats-url", nats_url,
                                   "--access-log", str(tmp_path / "missing" / "a.log")])
    assert res.exit_code == 1, res.output
    assert res.output.startswith("Error: cannot open the access log ") and "Traceback" not in res.output


LINE = {"at": "2026-12-03T10:00:00.5+00:00", "router": "r1", "route": CHAT, "caller": "alice", "tenant": "acme",
        "model": "tiny", "replica": "tiny-r1", "status": 200, "stream": True, "error": "", "prompt_tokens": 1200,
        "completion_tokens": 8, "cached_tokens": 1024, "queue_ms": 0.0, "wake_ms": 0.0, "ttft_ms": 41.25,
        "total_ms": 80.5}


def write_logs(tmp_path: Path) -> Path:
    """A data directory whose logs/ holds the access log and two rotated ones (one gzipped)."""
    logs = tmp_path / "data" / "logs"
    logs.mkdir(parents=True)
    (logs / "router-access.log").write_text(json.dumps({**LINE, "id": "now"}) + "\n")
    (logs / "router-access.log.1").write_text(json.dumps({**LINE, "id": "older"}) + "\n" + "{cut sh\n")
    with gzip.open(logs / "router-access.log.2.gz", "wt") as f:
        f.write(json.dumps({**LINE, "id": "oldest", "status": 504, "error": "upstream_timeout"}) + "\n")
    (logs / "router.log").write_text(json.dumps({**LINE, "id": "not-an-access-log"}) + "\n")
    return tmp_path / "data"


def test_ctl_request_finds_the_line_in_the_data_dirs_access_logs(tmp_path: Path) -> None:
    data = write_logs(tmp_path)
    runner = CliRunner()
    res = runner.invoke(cli, ["ctl", "request", "oldest", "--data-dir", str(data)])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines() == [
        "request oldest  at 2026-12-03 10:00:00.500 UTC  router r1",
        f"  {CHAT}  model tiny  replica tiny-r1  status 504 upstream_timeout streamed",
        "  key alice (tenant acme)",
        "  tokens: 1,200 prompt (1,024 cached), 8 completion",
        "  times: queue 0.0 ms, wake 0.0 ms, first byte 41.2 ms, total 80.5 ms",
        f"  in {data / 'logs' / 'router-access.log.2.gz'}",
    ]
    res = runner.invoke(cli, ["ctl", "request", "now", "--json"], env={"LLMGW_DATA_DIR": str(data)})
    assert res.exit_code == 0, res.output
    (found,) = json.loads(res.output)
    assert found == {**LINE, "id": "now", "at": "2026-12-03T10:00:00.500000Z",
                     "file": str(data / "logs" / "router-access.log")}
    res = runner.invoke(cli, ["ctl", "request", "older", "--log", str(data / "logs" / "router-access.log.1")])
    assert res.exit_code == 0 and "request older " in res.output


@pytest.mark.parametrize(("args", "said"), [
    (["not-an-access-log"], "Error: no request not-an-access-log in 3 access logs ("),
    (["bad id"], "Error: 'bad id' is not a request id (1 to 128 of letters, digits and ._:/+=@-); copy it from"),
    (["now", "--data-dir", "{empty}"], "Error: no access log in {empty}/logs (`llmgw up` writes router-access.log "
                                       "there); give --data-dir DIR, or --log FILE"),
    (["now", "--log", "{empty}/x.log"], "Error: no access log at {empty}/x.log; give --log the file"),
])
def test_ctl_request_says_what_it_searched_and_what_to_try(tmp_path: Path, args: list[str], said: str) -> None:
    data = write_logs(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    res = CliRunner().invoke(cli, ["ctl", "request", *(a.format(empty=empty) for a in args)],
                             env={"LLMGW_DATA_DIR": str(data)})
    assert res.exit_code == 1, res.output
    assert res.output.startswith(said.format(empty=empty)), res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize(("given", "expected"), [
    (None, "{logs}/router-access.log"),  # where `ctl request` looks by default
    ("-", "-"),  # the router's own log (logs/router.log under up)
    ("off", ""),
    ("elsewhere/a.log", "{cwd}/elsewhere/a.log"),  # the router child runs elsewhere: resolved here
])
def test_up_gives_its_router_the_access_log_it_was_told(
        given: str | None, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    logs = tmp_path / "data" / "logs"
    assert access_log_arg(given, logs) == expected.format(logs=logs, cwd=tmp_path)
