"""``llmgw scheduler``: place replicas, re-place them after faults, one decider at a time."""

from __future__ import annotations

import asyncio
import logging
import signal

import click

from llmgw.bus import Bus
from llmgw.cli.options import nats_options, run
from llmgw.config import Settings
from llmgw.scheduler import HeartbeatMonitor, Quarantine, SchedulerService


async def serve_scheduler(settings: Settings, name: str, lease_ttl_s: float, tick_s: float, heartbeat_timeout_s: float,
                          *, from_snapshot: bool = False, quarantine: Quarantine | None = None) -> None:
    """Run one scheduler and the liveness monitor until SIGINT/SIGTERM."""
    bus = await Bus.connect(settings, name or "llmgw-scheduler")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def liveness(b: Bus) -> None:
        await HeartbeatMonitor(b, timeout_s=heartbeat_timeout_s).run()

    try:
        await bus.ensure_streams(lease_ttl_s=lease_ttl_s)  # declares what is missing where it may (an open bus)
        sched = SchedulerService(bus, name=name, lease_ttl_s=lease_ttl_s, tick_s=tick_s, services=(liveness,),
                                 use_snapshots=from_snapshot, quarantine=quarantine or Quarantine())
        click.echo(f"scheduler {sched.name} on {settings.nats_url}: waiting for the lease (ttl {lease_ttl_s:g}s)", err=True)
        await sched.run(stop)
    finally:
        await bus.close()


@click.command("scheduler")
@nats_options
@click.option("--name", default="", help="This scheduler's name in the lease [default: a random one].")
@click.option("--lease-ttl", "lease_ttl_s", type=click.FloatRange(0.5), default=10.0, show_default=True, help="Seconds before a dead leader's lease passes to another scheduler.")
@click.option("--tick", "tick_s", type=click.FloatRange(0.05), default=1.0, show_default=True, help="Seconds between decision passes when nothing happens.")
@click.option("--from-snapshot", "from_snapshot", is_flag=True,
              help="Start from the newest fold snapshot instead of sequence 1: faster on a long history, but it "
                   "trusts whoever writes snapshots (the projector) with the models, nodes and demand it places by.")
@click.option("--heartbeat-timeout", "heartbeat_timeout_s", type=click.FloatRange(0.5, 86400), default=60.0, show_default=True, help="Seconds of silence before a node is declared lost.")
@click.option("--quarantine-faults", "quarantine_faults", type=click.IntRange(0, 10_000), default=3, show_default=True,
              help="GPU faults (a GPU going unhealthy, any reason) on one node within --quarantine-window that cordon "
                   "it as a quarantine until an operator uncordons it; 0: never for a count (fatal XIDs still do).")
@click.option("--quarantine-window", "quarantine_window_min", type=click.FloatRange(1, 7 * 24 * 60), default=60.0,
              show_default=True, help="Minutes over which --quarantine-faults are counted (at most 7 days: what is remembered).")
def scheduler(settings: Settings, name: str, lease_ttl_s: float, tick_s: float, from_snapshot: bool,
              heartbeat_timeout_s: float, quarantine_faults: int, quarantine_window_min: float) -> None:
    """Place declared models on free healthy GPUs; re-place after faults (one leader at a time).

    Example:

        llmgw scheduler --nats-url nats://127.0.0.1:4222 --lease-ttl 10 --heartbeat-timeout 30

        llmgw scheduler --quarantine-faults 5 --quarantine-window 30
    """
    if logging.getLogger().level > logging.INFO:
        logging.getLogger("llmgw.scheduler.service").setLevel(logging.INFO)
    policy = Quarantine(faults=quarantine_faults, window_s=quarantine_window_min * 60)
    run(serve_scheduler(settings, name, lease_ttl_s, tick_s, heartbeat_timeout_s, from_snapshot=from_snapshot,
                        quarantine=policy))
