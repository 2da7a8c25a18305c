"""The projector (`llmgw project`, a real child process) under faults: SIGKILL mid-replay, a burst, a full disk, a held file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from faultkit import T0, tables
from streams import fresh_streams

from llmgw import fleetfile, subjects
from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.bus.server import EmbeddedServer, free_port
from llmgw.config import Settings
from llmgw.projections.store import Store

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
FLEET = fleetfile.load(ROOT / "examples" / "fleet.toml")
LLMGW = str(Path(sys.executable).parent / "llmgw")


def history(n: int) -> list[m.Event]:
    """Inventories, then GPU health flips and idle maps: ``n`` distinct events over two streams."""
    out: list[m.Event] = list(fleetfile.inventories(FLEET, T0))
    nodes = [x.name for x in FLEET.nodes]
    i = 0
    while len(out) < n:
        at = T0 + timedelta(seconds=1 + i)
        if i % 25 == 24:
            out.append(m.IdleMapPublished(at=at, router="gw-1", boot_id="b1", tick=i, last_request={}))
        else:
            node = nodes[i % len(nodes)]
            out.append(m.GpuHealthChanged(at=at, node=node, gpu_index=i % 8, gpu_uuid=FLEET.node(node).gpu_uuid(i % 8),
                                          healthy=(i // len(nodes)) % 2 == 1, reasons=() if (i // len(nodes)) % 2 else ("xid 48",)))
        i += 1
    return out


class Server:
    def __init__(self, server: EmbeddedServer, monitor: int) -> None:
        self.server, self.monitor = server, monitor

    def varz(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor}/varz", timeout=5) as r:
            return dict(json.loads(r.read()))

    def consumers(self, stream: str) -> dict[str, int]:
        """Each consumer of ``stream`` and the furthest stream sequence it has been delivered."""
        url = f"http://127.0.0.1:{self.monitor}/jsz?accounts=true&streams=true&consumers=true"
        with urllib.request.urlopen(url, timeout=5) as r:
            data = json.loads(r.read())
        return {c["name"]: int(c["delivered"]["stream_seq"])
                for acct in data.get("account_details") or []
                for sd in acct.get("stream_detail") or [] if sd["name"] == stream
                for c in sd.get("consumer_detail") or []}

    def connz(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor}/connz?limit=1024", timeout=5) as r:
            return list(json.loads(r.read()).get("connections") or [])


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    d = Path(tempfile.mkdtemp(prefix="llmgw-fault-proj-"))
    port = free_port()
    s = EmbeddedServer(d, port=0, extra_args=("-m", str(port))).start()
    try:
        yield Server(s, port)
    finally:
        s.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def bus(server: Server) -> AsyncIterator[Bus]:
    b = await Bus.connect(Settings(nats_url=server.server.url), "fault-test")
    await fresh_streams(b)
    try:
        yield b
    finally:
        await b.close()


async def poll(cond: Callable[[], bool], limit_s: float) -> None:
    """Wait until ``cond()`` holds; fail after ``limit_s``."""
    for _ in range(int(limit_s * 10)):
        if await asyncio.to_thread(cond):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"not true after {limit_s:.0f}s: {cond}")


def env(bus: Bus) -> dict[str, str]:
    return {**os.environ, "LLMGW_NATS_URL": bus.settings.nats_url}


async def project(bus: Bus, db: Path, *args: str, limit_s: float = 120, **kw: Any) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(LLMGW, "project", "--once", "--db", str(db), *args, env=env(bus),
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, **kw)
    _, err = await asyncio.wait_for(proc.communicate(), limit_s)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


def positions(db: Path) -> dict[str, int]:
    store = Store(db)
    try:
        return dict(store.load().cursor.positions)
    finally:
        store.close()


class Throttled:
    """A child process group run in short random slices and stopped between them.

    Stopped, the child cannot move: whatever the server says it was delivered
    is where it stands, and a SIGKILL sent then always lands, however fast the
    machine folds. The slices' random lengths put the kill anywhere in reading,
    folding or committing (in the parent or in its DuckDB writer).
    """

    def __init__(self, proc: asyncio.subprocess.Process, rng: random.Random) -> None:
        self.proc, self.rng, self.slices = proc, rng, 0

    async def step(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # it ended on its own: the caller sees its exit
            os.killpg(self.proc.pid, signal.SIGCONT)
            await asyncio.sleep(self.rng.uniform(0.002, 0.025))
            os.killpg(self.proc.pid, signal.SIGSTOP)
        self.slices += 1

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the parent and its writer, as a node crash would


async def test_sigkill_at_random_points_of_a_large_replay(
    server: Server, bus: Bus, tmp_path: Path, record: Callable[..., None]
) -> None:
    n = 30_000
    await bus.publish_many(history(n))
    clean, crashed = tmp_path / "clean.duckdb", tmp_path / "crashed.duckdb"
    rc, err = await project(bus, clean)
    assert rc == 0, err
    fleet_last = await bus.stream_last_seq(subjects.STREAM_FLEET)
    # Kill points are positions in the replay, not times: the server says how far the
    # child's own consumer has been delivered while the child stands stopped.
    rng = random.Random(8)
    targets = sorted(rng.sample(range(1_000, fleet_last - 4_000), 4))
    kills: list[dict[str, Any]] = []
    for target in targets:
        before = set(server.consumers(subjects.STREAM_FLEET))  # killed children's consumers linger 30 s
        proc = await asyncio.create_subprocess_exec(LLMGW, "project", "--once", "--db", str(crashed), "--commit-every", "1000",
                                                    env=env(bus), stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
        child = Throttled(proc, rng)
        try:
            delivered = 0
            async with asyncio.timeout(120):
                while delivered < target and proc.returncode is None:
                    await child.step()
                    ours = {k: v for k, v in (await asyncio.to_thread(server.consumers, subjects.STREAM_FLEET)).items()
                            if k not in before}
                    delivered = max(ours.values(), default=0)
            # Delivery runs up to two read batches ahead of the fold: a few more slices
            # move the kill anywhere into folding and committing what was delivered.
            for _ in range(rng.randint(0, 6)):
                await child.step()
        finally:
            child.kill()
            await asyncio.wait_for(proc.wait(), 30)
        kills.append({"target": target, "delivered": delivered, "slices": child.slices, "exit": proc.returncode,
                      "checkpoint": sum(positions(crashed).values()) if crashed.exists() else 0})
    rc, err = await project(bus, crashed)
    assert rc == 0, err
    # Every kill landed mid-replay: none of the children finished on its own.
    assert [k["exit"] for k in kills] == [-signal.SIGKILL] * len(targets), kills
    assert tables(crashed) == tables(clean)
    stored = {s: await bus.stream_last_seq(s) for s in subjects.HISTORY_STREAMS}
    assert positions(clean) == {k: v for k, v in stored.items() if v}
    record(published=n, stored=sum(stored.values()), projected=sum(positions(crashed).values()), kills=kills,
           duplicates=len(tables(crashed)["events"]) - len({r[:2] for r in tables(crashed)["events"]}))


async def test_burst_larger_than_a_batch_never_makes_the_projector_slow(
    server: Server, bus: Bus, tmp_path: Path, record: Callable[..., None]
) -> None:
    n = 60_000
    db = tmp_path / "live.duckdb"
    slow_before = int(server.varz().get("slow_consumers", 0))
    proc = await asyncio.create_subprocess_exec(LLMGW, "project", "--db", str(db), "--analysts-copy-interval", "0",
                                                env=env(bus), stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        await poll(lambda: any(c.get("name") == "llmgw-project" for c in server.connz()), 30)
        cid = next(c["cid"] for c in server.connz() if c.get("name") == "llmgw-project")
        await bus.publish_many(history(n))  # ~7 of the projector's 8192-event batches at once
        want = await bus.stream_last_seq(subjects.STREAM_FLEET)
        report: m.StatusReport | None = None
        async with asyncio.timeout(90):
            while report is None or report.positions.get(subjects.STREAM_FLEET, 0) < want:
                await asyncio.sleep(0.2)
                report = m.STATUS_REPORT_DECODER.decode(await bus.request(subjects.STATUS, b"", timeout=10))
        conns = [c for c in server.connz() if c.get("name") == "llmgw-project"]
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    slow_after = int(server.varz().get("slow_consumers", 0))
    assert [c["cid"] for c in conns] == [cid]  # the same connection throughout: never dropped
    assert slow_after == slow_before, err.decode()
    assert proc.returncode == 0, err.decode()
    record(published=n, projected_live=sum(report.positions.values()), slow_consumers=slow_after - slow_before,
           projector_connections=len(conns))


async def test_a_reader_that_stalls_on_big_idle_maps_keeps_the_server_buffer_small(
    server: Server, bus: Bus, record: Callable[..., None]
) -> None:
    # Idle maps of a 4,000-replica fleet are ~200 KB each. What a reader has asked for and
    # not yet read waits in nats-server's buffer for the connection, which it drops as a
    # slow consumer past 64 MB: the reader's window is bounded in bytes, not only messages.
    at = T0 + timedelta(hours=1)
    maps = [m.IdleMapPublished(at=at + timedelta(seconds=10 * i), router="gw-1", boot_id="b1", tick=i,
                               last_request={f"replica-{r:05d}": at + timedelta(seconds=i, microseconds=r)
                                             for r in range(4000)})
            for i in range(300)]
    await bus.publish_many(maps)
    slow_before = int(server.varz().get("slow_consumers", 0))
    name = "llmgw-test-stalling-reader"
    reader = await Bus.connect(bus.settings, name)
    pending: list[int] = []
    watching = threading.Event()

    def watch() -> None:  # the server's view of this connection, while its loop stands still
        while watching.is_set():
            pending.extend(c.get("pending_bytes", 0) for c in server.connz() if c.get("name") == name)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    try:
        got: list[int] = []
        async for batch in reader.reader(subjects.STREAM_USAGE, batch=100, stop_at=len(maps)).batches():
            got.extend(x.seq for x in batch)
            if len(got) >= 50 and not watcher.is_alive():  # the window sized from what arrived
                watching.set()
                watcher.start()
                time.sleep(2)  # noqa: ASYNC251 - on purpose: the loop stands still, nothing is read
        reconnects = reader.nc.stats["reconnects"]
    finally:
        watching.clear()
        if watcher.is_alive():
            watcher.join()
        await reader.close()
    slow = int(server.varz().get("slow_consumers", 0)) - slow_before
    record(messages=len(maps), message_bytes=len(m.encode(maps[0])), max_pending_bytes=max(pending, default=0),
           slow_consumers=slow, reconnects=reconnects)
    assert got == list(range(1, len(maps) + 1))
    assert (slow, reconnects) == (0, 0)
    assert pending and max(pending) <= 12 << 20  # the reader's 8 MiB window, and some slack


def _limit_file_size(limit: int) -> Callable[[], None]:
    def pre() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return pre


async def test_disk_full_stops_with_a_clear_error_and_resumes(bus: Bus, tmp_path: Path, record: Callable[..., None]) -> None:
    n = 20_000
    await bus.publish_many(history(n))
    clean, full = tmp_path / "clean.duckdb", tmp_path / "full.duckdb"
    assert (await project(bus, clean))[0] == 0
    # Room for about nine tenths of what the whole history needs: the disk fills mid-replay.
    limit = max(1 << 20, clean.stat().st_size * 9 // 10)
    fault_rc, fault_err = await project(bus, full, "--commit-every", "500", preexec_fn=_limit_file_size(limit))
    assert fault_rc != 0, fault_err
    at_fault = positions(full)  # the checkpoint is readable and agrees with its state (Store.load checks)
    assert sum(at_fault.values()) < n
    rc, err = await project(bus, full)
    assert rc == 0, err
    assert tables(full) == tables(clean)
    last = fault_err.strip().splitlines()[-1]
    record(published=n, checkpoint_at_fault=sum(at_fault.values()), exit_status=fault_rc, file_size_limit=limit,
           projected_after_resume=sum(positions(full).values()), error=last[:200])
    # What the operator sees is the real cause, in one Error line.
    assert fault_rc == 1 and fault_err.startswith("Error:") and "Traceback" not in fault_err, fault_err
    assert "File too large" in fault_err or "disk" in fault_err.lower(), last


async def test_file_held_by_another_projector_is_refused_then_resumes(bus: Bus, tmp_path: Path, record: Callable[..., None]) -> None:
    n = 5_000
    await bus.publish_many(history(n))
    db, clean = tmp_path / "held.duckdb", tmp_path / "clean.duckdb"
    assert (await project(bus, clean))[0] == 0
    holder = await asyncio.create_subprocess_exec(LLMGW, "project", "--db", str(db), "--analysts-copy-interval", "0",
                                                  env=env(bus), stdout=asyncio.subprocess.DEVNULL,
                                                  stderr=asyncio.subprocess.DEVNULL)
    try:
        await poll(db.exists, 30)
        rc, err = await project(bus, db)
    finally:
        holder.send_signal(signal.SIGTERM)
        await asyncio.wait_for(holder.wait(), 30)
    assert rc == 1 and "Traceback" not in err
    assert "another projector may hold it" in err
    rc2, err2 = await project(bus, db)
    assert rc2 == 0, err2
    assert tables(db) == tables(clean)
    record(published=n, second_projector_exit=rc, error=err.strip().splitlines()[-1][:160])
