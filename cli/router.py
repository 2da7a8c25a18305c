"""``llmgw router``: the OpenAI-compatible gateway in front of the replicas."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import click

from llmgw.apikeys import load_api_keys
from llmgw.bus import Bus
from llmgw.cli.options import checked_name, nats_options, run
from llmgw.config import Settings
from llmgw.engine import Timeouts
from llmgw.router import DEFAULT_MAX_BODY, serve_router


def listen_address(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise click.BadParameter(f"{value!r} is not HOST:PORT; try 127.0.0.1:8080 (port 0 picks a free one)")
    return host.strip("[]") or "0.0.0.0", int(port)


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """``32MiB``, ``512KiB``, ``1048576``: a size in bytes, binary units (K, M, G are KiB, MiB, GiB)."""
    if value is None:
        return None
    got = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", value.lower())
    n = int(float(got[1]) * _UNITS[got[2]]) if got and got[2] in _UNITS else 0
    if n < 1:
        raise click.BadParameter(f"{value!r} is not a size of at least 1 byte; e.g. 32MiB, 512KiB or 1048576 (bytes)")
    return n


def _otlp_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not value.startswith(("http://", "https://")):
        raise click.BadParameter(f"{value!r} is not an http(s) URL; give the collector's OTLP/HTTP base, "
                                 "e.g. http://127.0.0.1:4318")
    return value


@click.command("router")
@click.option("--listen", default="127.0.0.1:8080", show_default=True, help="HOST:PORT to serve the OpenAI API on.")
@click.option("--name", default=socket.gethostname, show_default="hostname", callback=checked_name,
              help="Router name in idle maps; give each router of a fleet its own.")
@click.option("--tick", "tick_s", type=click.FloatRange(0.05, 3600), default=10.0, show_default=True,
              help="Seconds between idle maps.")
@click.option("--api-keys", "api_keys", type=click.Path(dir_okay=False),
              help="File of sha256 hex digests of accepted keys, one per line (# comments); off when absent.")
@click.option("--max-body", metavar="SIZE", callback=_size, show_default=f"{DEFAULT_MAX_BODY >> 20}MiB",
              help="Largest request body the router takes (e.g. 512KiB, 64MiB); larger gets 413 and is not forwarded.")
@click.option("--max-body-mb", type=click.FloatRange(min=0.001), hidden=True,
              help="The same limit in MiB (older spelling of --max-body).")
@click.option("--connect-timeout", type=click.FloatRange(min=0.1), default=5.0, show_default=True,
              help="Seconds to connect to a replica before trying another.")
@click.option("--read-timeout", type=click.FloatRange(min=0.1), default=300.0, show_default=True,
              help="Seconds to wait for a replica's answer, and between streamed chunks.")
@click.option("--body-timeout", type=click.FloatRange(min=0.1), default=30.0, show_default=True,
              help="Seconds a client may take to send its request body; slower gets 408.")
@click.option("--header-timeout", type=click.FloatRange(min=0.1), default=30.0, show_default=True,
              help="Seconds a connection may take to send a whole request head (also how long an idle "
                   "keep-alive connection is kept); slower is closed.")
@click.option("--wake-timeout", type=click.FloatRange(min=0), default=120.0, show_default=True,
              help="Seconds to hold a request for a parked model while it wakes; then 503 with Retry-After.")
@click.option("--max-connections-per-client", type=click.IntRange(min=0), default=0, show_default=True,
              help="Open sockets one address (an IPv6 /64) may hold; past it a new one is closed at once. 0: no "
                   "cap (behind a load balancer every socket is the balancer's); set it where clients connect "
                   "directly, e.g. 512.")
@click.option("--access-log", metavar="FILE|-",
              help="Write one JSON line per request here (- for standard output): its id, key, model, replica, "
                   "status, tokens and times; `llmgw ctl request ID --log FILE` finds one. SIGUSR1 reopens the "
                   "file (logrotate). Off when absent.")
@click.option("--otlp-endpoint", metavar="URL", callback=_otlp_url,
              help="Export an OpenTelemetry span per request, and one per replica asked, to this OTLP/HTTP "
                   "collector (e.g. http://127.0.0.1:4318); needs `pip install 'llmgw[otel]'`. Off when absent.")
@click.option("--quota-journal", type=click.Path(dir_okay=False, path_type=Path),
              help="File where each key's counts are written as they are made, until an idle map carries them: a "
                   "router killed between two ticks loses none (docs/reliability.md). Off when absent; "
                   "`llmgw up` keeps one in its data directory.")
@click.option("--no-idle-tracking", is_flag=True, help="Publish no idle maps (benchmarks only: the fleet then cannot tell what is idle).")
@nats_options
def router(listen: str, name: str, tick_s: float, api_keys: str | None, max_body: int | None, max_body_mb: float | None,
           connect_timeout: float, read_timeout: float, body_timeout: float, header_timeout: float,
           wake_timeout: float, max_connections_per_client: int, access_log: str | None, otlp_endpoint: str | None,
           quota_journal: Path | None, no_idle_tracking: bool,
           settings: Settings) -> None:
    """Serve the OpenAI API in front of the healthy replicas; prints its URL on the first line.

    Endpoints come from the control stream; an idle map goes to the usage
    stream once a tick. GET /metrics is Prometheus text, GET /health readiness.

    Example:

    \b
        llmgw router --listen 127.0.0.1:8080 --name router-a
        llmgw router --listen 0.0.0.0:8080 --api-keys keys.sha256 --tick 10
        llmgw router --access-log /var/log/llmgw/router-access.log
    """
    host, port = listen_address(listen)
    if max_body is not None and max_body_mb is not None:
        raise click.UsageError("give --max-body or its older spelling --max-body-mb, not both")
    limit = max_body or (int(max_body_mb * 1024 * 1024) if max_body_mb is not None else DEFAULT_MAX_BODY)
    keys = load_api_keys(api_keys) if api_keys else frozenset()

    async def main() -> None:
        bus = await Bus.connect(settings, f"llmgw-router-{name}")
        try:
            await serve_router(bus, name, host, port, tick_s=tick_s, api_keys=keys,
                               max_body_bytes=limit,
                               timeouts=Timeouts(connect_s=connect_timeout, read_s=read_timeout),
                               idle_tracking=not no_idle_tracking, body_timeout_s=body_timeout,
                               wake_timeout_s=wake_timeout, header_timeout_s=header_timeout,
                               max_connections_per_client=max_connections_per_client, access_log=access_log,
                               otlp_endpoint=otlp_endpoint, journal=quota_journal)
        finally:
            await bus.close()

    run(main())
