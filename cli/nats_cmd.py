"""``llmgw nats``: the embedded nats-server with JetStream and llmgw's streams."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import click

from llmgw.bus import Bus, EmbeddedServer
from llmgw.cli.options import run
from llmgw.config import Settings, data_dir


async def declare_streams(url: str, replicas: int = 1) -> None:
    bus = await Bus.connect(Settings(nats_url=url, stream_replicas=replicas), "llmgw-nats", reconnect=False)
    try:
        await bus.ensure_streams()
    finally:
        await bus.close()


def wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass


@click.command("nats")
@click.option("--data-dir", type=click.Path(path_type=Path), default=None, help="JetStream store [default: <data dir>/nats].")
@click.option("--port", type=int, default=4222, show_default=True, help="Client port on loopback (0 picks a free one).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="A nats-server config (e.g. nats.conf) for users and TLS.")
def nats_cmd(data_dir: Path | None, port: int, host: str, config_file: Path | None) -> None:
    """Run the embedded nats-server (JetStream on) and declare llmgw's streams.

    Example:

        llmgw nats --port 4222 --data-dir ./llmgw-data/nats
    """
    from llmgw.config import data_dir as default_data_dir

    store = data_dir or default_data_dir() / "nats"
    try:
        server = EmbeddedServer(store, port=port, host=host, config_file=config_file).start()
    except OSError as e:  # the store cannot be created there (/proc, read-only, a file in the way)
        raise click.ClickException(f"cannot use {store} as the JetStream store ({e.strerror or e}); "
                                   "pass --data-dir DIR in a directory you can write") from e
    try:
        if config_file is None:
            run(declare_streams(server.url))
        click.echo(f"nats-server listening on {server.url} (JetStream store {store}); Ctrl-C stops it")
        wait_for_signal()
    finally:
        server.stop()
        click.echo("nats-server stopped")


__all__ = ["nats_cmd", "declare_streams", "wait_for_signal", "data_dir"]
