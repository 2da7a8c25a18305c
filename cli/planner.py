"""``llmgw planner``: the plan service process."""

from __future__ import annotations

import asyncio
import signal

import click

from llmgw.cli.options import nats_options, run
from llmgw.config import Settings


async def serve(settings: Settings, models_dir: str | None) -> None:
    """Run one planner until SIGINT/SIGTERM."""
    from llmgw import subjects
    from llmgw.bus import Bus
    from llmgw.planner import PlannerService

    bus = await Bus.connect(settings, "llmgw-planner")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    service = PlannerService(bus, models_dir=models_dir)
    task = asyncio.create_task(service.run())
    ready = asyncio.create_task(service.ready.wait())
    try:
        await asyncio.wait([ready, task], return_when=asyncio.FIRST_COMPLETED)
        if service.ready.is_set():
            click.echo(f"planner answering on {subjects.PLAN} (queue {subjects.PLANNER_QUEUE}) with "
                       f"{len(service.state.nodes)} nodes folded; Ctrl-C stops it")
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([stopping, task], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
    finally:
        ready.cancel()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        await bus.close()


@click.command("planner")
@click.option("--models-dir", envvar="LLMGW_MODELS_DIR",
              help="Directory of Org__Name model folders holding config.json [env LLMGW_MODELS_DIR].")
@nats_options
def planner(models_dir: str | None, settings: Settings) -> None:
    """Answer plan requests over NATS, from its own fold of the fleet and control streams.

    Run several: they share requests in one queue group.

    Example:

    \b
        llmgw planner --nats-url nats://127.0.0.1:4222 --models-dir examples/models
    """
    run(serve(settings, models_dir))
