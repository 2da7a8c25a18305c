"""Random, well-typed but extreme events into a running projector and scheduler: nothing stops, live = replay.

Integers at their bounds and one past them, times far in the future and the
past, names of nodes nobody reported, events published on another node's
subject. The projector (with a DuckDB file) and the scheduler must fold every
one of them or set it aside, keep running, and ``ctl status`` must say what
``ctl status --replay`` says. A few examples of a few dozen events each: seconds.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
from click.testing import CliRunner
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from streams import fresh_streams

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.config import Settings
from llmgw.projections.runner import Projector
from llmgw.projections.store import Store
from llmgw.scheduler.service import SchedulerService

NOW = datetime.now(UTC)
NODES = ["n1", "n2", "n3-foreign", "x" * m.NAME_MAX]
MODELS = ["a", "b", "c" * m.NAME_MAX]


def edges(low: int, high: int) -> st.SearchStrategy[int]:
    """At the bounds, one past them, and a few far past: what a decoder must take or refuse."""
    return st.sampled_from([low, low + 1, high - 1, high, high + 1, low - 1, 2**31, 2**40, 2**63, 2**64, -(2**63)])


times = st.sampled_from([NOW, NOW + timedelta(minutes=4), NOW + timedelta(minutes=6), NOW - timedelta(days=400),
                         datetime(9999, 12, 31, 23, 59, tzinfo=UTC), datetime(1970, 1, 1, tzinfo=UTC),
                         datetime(1, 1, 1, tzinfo=UTC)])
names = st.sampled_from(NODES) | st.sampled_from(["", "new\nline", "a b"])
gpus = st.builds(m.GpuInfo, index=edges(0, m.MAX_GPUS - 1), uuid=st.sampled_from(["GPU-0", "GPU-1", "G" * 300]),
                 name=st.just("NVIDIA H100"), gpu_class=st.sampled_from(["H100-80GB", "L40S-48GB"]),
                 memory_mib=edges(0, 1 << 30), healthy=st.booleans())
specs = st.builds(m.ModelSpec, name=st.sampled_from(MODELS), source=st.just("org/m"), precision=st.just("bf16"),
                  engine=st.just("vllm"), gpu_class=st.sampled_from(["H100-80GB", "L40S-48GB"]),
                  context=edges(0, 1 << 30), tp=edges(1, m.MAX_GPUS), pp=st.sampled_from([1, 1, 2, m.MAX_GPUS + 1]),
                  replicas=edges(0, m.MAX_REPLICAS), idle_ttl_s=st.sampled_from([None, 0.0, 1.0, 1e300]))
events = st.one_of(
    st.builds(m.NodeInventoryReported, at=times, node=names, fabric=st.just("ib-a"), fabric_source=st.just("flag"),
              boot_id=st.just("b"), gpus=st.lists(gpus, max_size=3).map(tuple)),
    st.builds(m.GpuHealthChanged, at=times, node=names, gpu_index=edges(0, m.MAX_GPUS - 1), gpu_uuid=st.just("GPU-0"),
              healthy=st.booleans()),
    st.builds(m.NodeLost, at=times, node=names),
    st.builds(m.NodeReturned, at=times, node=names),
    st.builds(m.ModelDeclared, at=times, spec=specs),
    st.builds(m.ModelScaled, at=times, name=st.sampled_from(MODELS), replicas=edges(0, m.MAX_REPLICAS)),
    st.builds(m.ModelRemoved, at=times, name=st.sampled_from(MODELS)),
    st.builds(m.ReplicaStateChanged, at=times, replica_id=st.sampled_from(["a-r1", "b-r1", "zz-r9"]),
              model=st.sampled_from(MODELS), node=names, state=st.sampled_from(["starting", "healthy", "failed"]),
              restarts=edges(0, 1_000_000), observed_kv_tokens=edges(0, 2**63 - 1)),
    st.builds(m.IdleMapPublished, at=times, router=st.sampled_from(["r1", "r 2"]), boot_id=st.just("b"),
              tick=edges(0, 2**63 - 1), last_request=st.dictionaries(st.sampled_from(["a-r1", "b-r1"]), times, max_size=2),
              control_seq=edges(0, 2**63 - 1)),
)
# Each event, and whether it goes out on another node's subject (a subject is a claim the payload may contradict).
plans = st.lists(st.tuples(events, st.sampled_from(NODES[:2]) | st.none()), min_size=5, max_size=30)


def _subject(event: m.Event, foreign: str | None) -> str:
    if getattr(event, "node", None) == "":  # no subject has an empty token: the claim goes out under n1's
        event = msgspec.structs.replace(event, node="n1")  # type: ignore[call-arg]
    subject = subjects.subject_for(event)
    if foreign is not None and subject.startswith("llmgw.fleet."):
        return subjects.fleet(foreign, subject.rsplit(".", 1)[1])
    return subject


async def _quiet(bus: Bus, projector: Projector, sched: SchedulerService, tasks: list[asyncio.Task[Any]]) -> None:
    """Wait until both have folded everything stored, twice in a row; fail at once if either stopped."""
    loop = asyncio.get_running_loop()
    deadline, same = loop.time() + 30, 0
    last: dict[str, int] = {}
    while same < 2:
        for t in tasks:
            assert not t.done(), f"a component stopped: {t.exception() if not t.cancelled() else 'cancelled'}"
        assert loop.time() < deadline, f"not caught up: {projector.cursor.positions} / {sched.stats.applied}"
        heads = {s: await bus.stream_last_seq(s) for s in subjects.HISTORY_STREAMS}
        caught = all(projector.cursor.positions.get(s, 0) >= n for s, n in heads.items()) and \
            all(sched.stats.applied.get(s, 0) >= n for s, n in heads.items() if s in sched.stats.applied)
        same = same + 1 if caught and heads == last else 0
        last = heads
        await asyncio.sleep(0.3)


async def _status(settings: Settings, *extra: str) -> dict[str, Any]:
    r = await asyncio.to_thread(CliRunner().invoke, cli, ["ctl", "status", "--json", "--nats-url", settings.nats_url, *extra])
    assert r.exit_code == 0, r.output
    doc: dict[str, Any] = json.loads(r.output)
    return doc


async def _run(settings: Settings, db: Path, plan: list[tuple[m.Event, str | None]]) -> None:
    bus = await Bus.connect(settings, "llmgw-test-poison")
    try:
        await fresh_streams(bus)
        projector = Projector(bus, Store(db), commit_interval_s=0.1)
        sched = SchedulerService(bus, name="poison", lease_ttl_s=2.0, tick_s=0.1)
        stop = asyncio.Event()
        tasks = [asyncio.create_task(projector.run_forever()), asyncio.create_task(sched.run(stop))]
        try:
            for i, (event, foreign) in enumerate(plan):
                await bus.publish_bytes(_subject(event, foreign), m.encode(event), f"poison-{i}")
            await _quiet(bus, projector, sched, tasks)
            stop.set()  # the scheduler decides no more: live and replay then read the same streams
            await asyncio.wait_for(tasks[1], 15)
            await _quiet(bus, projector, sched, tasks[:1])
            await projector.flush()  # a commit DuckDB refused would raise here
            live = await _status(settings)
            replayed = await _status(settings, "--replay")
            assert live == replayed
            assert not tasks[0].done()
        finally:
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await bus.close()


# No shrinking: each example runs real services for a few seconds; the failing plan is printed whole.
@settings(max_examples=3, deadline=None, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(plan=plans)
def test_extreme_events_stop_nothing_and_live_status_equals_replay(plan: list[tuple[m.Event, str | None]],
                                                                   nats_url: str, tmp_path: Path) -> None:
    db = tmp_path / f"poison-{uuid.uuid4().hex}.duckdb"  # a fresh file per example: the streams are fresh too
    asyncio.run(asyncio.wait_for(_run(Settings(nats_url=nats_url), db, plan), 90))
