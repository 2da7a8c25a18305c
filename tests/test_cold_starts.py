"""The cold-start ledger: a wake's phases from wanted to first byte, on the streams and in ``ctl model show``.

Real nats-server, a real router and a fake engine process; the test publishes what
the scheduler and the agent publish when they answer a wish (test_e2e_demand runs them
for real), and folds the streams as every reader does.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import aiohttp
import duckdb
import pytest
from click.testing import CliRunner
from running import engines as running_engines
from running import until

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.config import Settings
from llmgw.fleet.fold import Checkpoint, fold_batch
from llmgw.fleet.history import ModelHistory
from llmgw.fleet.replay import replay
from llmgw.projections import schema
from llmgw.router.server import Router

MODEL = "sleepy"
T0 = datetime(2026, 3, 2, 10, 0, tzinfo=UTC)


def now() -> datetime:
    return datetime.now(UTC)


def spec(name: str = MODEL) -> m.ModelSpec:
    return m.ModelSpec(name=name, source="x", precision="bf16", engine="vllm", gpu_class="H100", context=4096,
                       idle_ttl_s=60.0)


def placed(rid: str, at: datetime, *, cause: str = "", reason: str = "") -> m.ReplicaPlaced:
    return m.ReplicaPlaced(at=at, replica_id=rid, model=MODEL, nodes=("n1",), spec=spec(), cause=cause, reason=reason,
                           gpus=(m.GpuRef(node="n1", index=0, uuid=f"GPU-{rid}"),))


def state(rid: str, at: datetime, st: str) -> m.ReplicaStateChanged:
    return m.ReplicaStateChanged(at=at, replica_id=rid, model=MODEL, node="n1", state=st)  # type: ignore[arg-type]


def answered(rid: str, at: datetime, requests: int = 2, router: str = "gw") -> m.WakeAnswered:
    return m.WakeAnswered(at=at, router=router, boot_id="b", model=MODEL, replica_id=rid,
                          held_since=T0, released_at=at - timedelta(seconds=0.1), requests=requests,
                          waits_s=(3.0, 4.5)[:requests])


async def test_a_wake_through_the_router_leaves_every_phase_on_the_streams(bus: Bus, settings: Settings) -> None:
    await bus.publish(m.ModelDeclared(at=now(), spec=spec()))
    router = Router(bus, "gw-ledger", tick_s=3600, wake_timeout_s=30)
    await router.start("127.0.0.1", 0)
    try:
        await router.sink.wait_for(lambda p: MODEL in p.declared)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as session:
            async def ask() -> int:
                async with session.post(router.url + "/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    return resp.status

            asks = [asyncio.create_task(ask()) for _ in range(3)]
            await until(lambda: len(router.waiting.get(MODEL, ())) == 3, "three requests held", 20)
            with running_engines(R=(MODEL,)) as procs:
                rid = f"{MODEL}-r1"
                await bus.publish(placed(rid, now(), cause="wake", reason="woken by gw-ledger: 3 requests waiting"))
                await bus.publish(state(rid, now(), "starting"))
                await bus.publish(m.ReplicaStateChanged(at=now(), replica_id=rid, model=MODEL, node="n1",
                                                        state="healthy", endpoint=procs["R"].url))
                assert await asyncio.wait_for(asyncio.gather(*asks), 30) == [200, 200, 200]
        await router.publish_idle_map()  # the wake goes out with the next map
    finally:
        await router.stop()

    c = await replay(bus)
    (start,) = c.history.cold_starts(MODEL)
    assert start.cause == "wake" and start.requests == 3 and len(start.waits_s) == 3
    phases = [start.wanted_at, start.placed_at, start.started_at, start.healthy_at, start.released_at,
              start.first_byte_at]
    assert None not in phases
    assert phases == sorted(phases)  # type: ignore[type-var]
    assert start.total_s is not None and start.total_s > 0
    assert max(start.waits_s) <= start.total_s

    result = await asyncio.to_thread(CliRunner().invoke, cli, ["ctl", "model", "show", MODEL, "--replay",
                                                                "--nats-url", settings.nats_url])
    assert result.exit_code == 0, result.output
    assert "Cold starts: 1 (1 wakes, 0 scale-ups)" in result.output
    assert "3 requests waited" in result.output
    timeline = await asyncio.to_thread(CliRunner().invoke, cli, ["replay", "--model", MODEL, "--nats-url",
                                                                  settings.nats_url])
    assert "router gw-ledger sent 3 held requests for sleepy on to sleepy-r1" in timeline.output


class _At:
    def __init__(self, seq: int, subject: str, ts: datetime) -> None:
        self.seq, self.subject, self.ts_ns = seq, subject, int(ts.timestamp() * 1e9)


def _fold(pairs: list[tuple[str, m.Event]]) -> ModelHistory:
    c = Checkpoint()
    seqs: dict[str, int] = {}
    for stream, event in pairs:
        seqs[stream] = seqs.get(stream, 0) + 1
        fold_batch(c, stream, [_At(seqs[stream], subjects.subject_for(event), event.at)], [event])
    return c.history


CONTROL = [(subjects.STREAM_CONTROL, e) for e in (
    m.ModelDeclared(at=T0, spec=spec()),
    placed(f"{MODEL}-r1", T0 + timedelta(seconds=1), reason="0 of 1 running"),  # a deploy: no cold start
    placed(f"{MODEL}-r2", T0 + timedelta(seconds=2), reason="woken by gw: 2 requests waiting"),  # before `cause`
    state(f"{MODEL}-r2", T0 + timedelta(seconds=3), "starting"),
    state(f"{MODEL}-r2", T0 + timedelta(seconds=5), "healthy"),
    state(f"{MODEL}-r2", T0 + timedelta(seconds=9), "healthy"),  # again: the first one counts
    placed(f"{MODEL}-r3", T0 + timedelta(seconds=20), cause="scale-up", reason="scaled up: …"),
)]
USAGE = [(subjects.STREAM_USAGE, answered(f"{MODEL}-r2", T0 + timedelta(seconds=6))),
         (subjects.STREAM_USAGE, answered(f"{MODEL}-r2", T0 + timedelta(seconds=5.5), requests=1, router="gw2"))]


@pytest.mark.parametrize("order", ["control first", "usage first"])
def test_the_ledger_joins_both_streams_whichever_comes_first(order: str) -> None:
    history = _fold(CONTROL + USAGE if order == "control first" else USAGE + CONTROL)
    wake, up = history.cold_starts(MODEL)
    assert (wake.replica_id, wake.cause, up.replica_id, up.cause) == (f"{MODEL}-r2", "wake", f"{MODEL}-r3", "scale-up")
    assert wake.wanted_at == T0 and wake.healthy_at == T0 + timedelta(seconds=5)
    assert wake.first_byte_at == T0 + timedelta(seconds=5.5)  # the earlier of two routers
    assert wake.requests == 3 and wake.waits_s == (3.0, 3.0, 4.5)
    assert wake.total_s == 5.5
    assert up.wanted_at == up.placed_at and up.requests == 0 and up.total_s is None  # not yet healthy
    assert history.start_count == {MODEL: 2}


def test_the_cold_starts_view_reads_the_same_phases(tmp_path: object) -> None:
    con = duckdb.connect()
    for sql in schema.statements():
        con.execute(sql)
    rows = [(subjects.STREAM_CONTROL, i + 1, e) for i, (_, e) in enumerate(CONTROL)]
    rows += [(subjects.STREAM_USAGE, i + 1, e) for i, (_, e) in enumerate(USAGE)]
    for stream, seq, e in rows:
        model = getattr(e, "model", None) or getattr(e, "name", None) or MODEL
        rid = getattr(e, "replica_id", None)
        con.execute("INSERT INTO events (stream, seq, type, ts, model, replica_id, json) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [stream, seq, type(e).__name__, e.at, model, rid, m.encode(e).decode()])
        if isinstance(e, m.ReplicaPlaced | m.ReplicaStateChanged):
            kind = "placed" if isinstance(e, m.ReplicaPlaced) else "state"
            con.execute("INSERT INTO replica_lifecycle (stream, seq, ts, replica_id, model, kind, state, detail) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        [stream, seq, e.at, e.replica_id, MODEL, kind, "placed" if kind == "placed" else e.state, ""])
    got = con.execute("SELECT replica_id, cause, epoch(started_at - placed_at), epoch(healthy_at - placed_at), "
                      "requests, total_s FROM cold_starts ORDER BY placed_at").fetchall()
    assert got == [(f"{MODEL}-r2", "wake", 1.0, 3.0, 3, 5.5), (f"{MODEL}-r3", "scale-up", None, None, 0, None)]
