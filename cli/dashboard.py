"""``llmgw dashboard``: the read-only web page of the fleet, live."""

from __future__ import annotations

import asyncio
import signal

import click

from llmgw.apikeys import load_api_keys
from llmgw.bus import Bus
from llmgw.cli.options import nats_options, run
from llmgw.cli.router import listen_address
from llmgw.config import Settings
from llmgw.dashboard import Dashboard, Limits


@click.command("dashboard")
@click.option("--listen", default="127.0.0.1:8081", show_default=True, help="HOST:PORT to serve the page on (port 0: a free one).")
@click.option("--api-keys", "api_keys", type=click.Path(dir_okay=False),
              help="The router's key file (sha256 hex digests, one per line): its keys open the page as an admin's. "
                   "`ctl key create --scope viewer|admin` keys open it too; with neither, no login.")
@click.option("--interval", "interval_s", type=click.FloatRange(min=0.2), default=5.0, show_default=True,
              help="Seconds between status requests while a page is open and no event arrives (an event asks at once).")
@click.option("--events", type=click.IntRange(1, 1000), default=50, show_default=True,
              help="Recent events in the timeline.")
@click.option("--max-pages", type=click.IntRange(min=1), default=Limits().pages, show_default=True,
              help="Open pages (live event streams) at once; past it a page is refused (503).")
@click.option("--max-pages-per-client", type=click.IntRange(min=1), default=Limits().pages_per_client,
              show_default=True, help="Open pages from one address (an IPv6 /64); past it 429. Behind a proxy "
                                      "every page comes from the proxy's address: raise it to --max-pages.")
@click.option("--max-connections-per-client", type=click.IntRange(min=1), default=Limits().connections_per_client,
              show_default=True, help="Open sockets from one address, pages or not; past it a new one is closed at "
                                      "once. Behind a proxy every socket is the proxy's: raise it.")
@nats_options
def dashboard(listen: str, api_keys: str | None, interval_s: float, events: int, max_pages: int,
              max_pages_per_client: int, max_connections_per_client: int, settings: Settings) -> None:
    """Serve a live, read-only web page of the fleet; prints its URL on the first line.

    What needs attention, capacity per GPU class, free whole nodes per fabric,
    models and replicas, GPU use per node and the latest events, from the
    projector's status service and the history streams; tenants' usage to an
    admin's key alone. One process serves any number of open pages.

    Example:

    \b
        llmgw dashboard --listen 127.0.0.1:8081
        llmgw dashboard --listen 0.0.0.0:8081 --api-keys keys.sha256
    """
    host, port = listen_address(listen)
    keys = load_api_keys(api_keys) if api_keys else frozenset()

    async def main() -> None:
        bus = await Bus.connect(settings, "llmgw-dashboard")
        limits = Limits(pages=max_pages, pages_per_client=max_pages_per_client,
                        connections_per_client=max_connections_per_client)
        board = Dashboard(bus, api_keys=keys, interval_s=interval_s, events=events, limits=limits)
        try:
            url = await board.start(host, port)
            click.echo(url)
            stopping = asyncio.Event()
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, stopping.set)
            await stopping.wait()
        finally:
            await board.stop()
            await bus.close()

    run(main())
