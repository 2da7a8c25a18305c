"""Helpers for the fault tests: distinct events, cluster state per node, waiting for quorum."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple

from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.bus.server import Cluster
from llmgw.config import Settings
from llmgw.errors import BusError

T0 = datetime(2026, 5, 1, tzinfo=UTC)


def health_event(i: int, node: str = "n-fault") -> m.GpuHealthChanged:
    """The i-th distinct fleet event: its own time and GPU, so every one is a new fact."""
    return m.GpuHealthChanged(at=T0 + timedelta(milliseconds=i), node=node, gpu_index=i % 8,
                              gpu_uuid=f"GPU-{i % 8}", healthy=i % 3 != 0, reasons=(f"#{i}",))


async def wait_streams(bus: Bus, replicas: int, limit_s: float = 30) -> None:
    """Declare the streams once JetStream has a meta leader (a new cluster needs a few seconds)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while True:
        try:
            await bus.ensure_streams(replicas)
            return
        except BusError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.5)


def node_last_seqs(cluster: Cluster, stream: str) -> dict[str, int]:
    """Each running node's own last sequence for a stream, from its /jsz (not the leader's view)."""
    out: dict[str, int] = {}
    for i, (server, port) in enumerate(zip(cluster.servers, cluster.monitor_ports, strict=True)):
        if server.proc is None or server.proc.poll() is not None:
            continue
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/jsz?accounts=true&streams=true", timeout=5) as r:
            data = json.loads(r.read())
        seq = 0
        for acct in data.get("account_details") or []:
            for sd in acct.get("stream_detail") or []:
                if sd["name"] == stream:
                    seq = int(sd["state"]["last_seq"])
        out[f"n{i}"] = seq
    return out


async def stream_leader(bus: Bus, stream: str) -> str:
    info = await bus.js.stream_info(stream)
    assert info.cluster is not None and info.cluster.leader
    return str(info.cluster.leader)


def cluster_settings(cluster: Cluster) -> Settings:
    return Settings(nats_url=cluster.url, stream_replicas=3, connect_timeout_s=2, request_timeout_s=2)


def tables(db: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every table of a projector's DuckDB file, rows in a stable order (to compare two files)."""
    from llmgw.projections.store import Store

    store = Store(db)
    try:
        names = sorted(r[0] for r in store.query("SELECT table_name FROM information_schema.tables WHERE table_schema = 'main'"))
        return {t: sorted(store.query(f'SELECT * FROM "{t}"'), key=repr) for t in names}
    finally:
        store.close()


async def caught_up(flag: asyncio.Event, reader: asyncio.Task[None], limit_s: float) -> None:
    """Wait for ``flag``; a reader task that died raises its own error instead of a bare timeout."""
    waiter = asyncio.ensure_future(flag.wait())
    try:
        done, _ = await asyncio.wait({waiter, reader}, timeout=limit_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if reader in done:
        reader.result()
        raise AssertionError("the reader stopped before it caught up")
    if waiter not in done:
        raise AssertionError(f"the reader did not catch up within {limit_s:.0f}s")


class Proc(NamedTuple):
    pid: int
    ppid: int
    argv: list[bytes]


def live_processes() -> list[Proc]:
    """Every process in /proc that is not a zombie, with its parent and command line."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        if fields[0] != b"Z":
            out.append(Proc(int(entry.name), int(fields[1]), argv))
    return out


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False
