"""``llmgw ctl request ID``: one request's line in the routers' access logs."""

from __future__ import annotations

from pathlib import Path

import click
import msgspec

from llmgw import messages as m
from llmgw.cli.options import echo_json, json_option
from llmgw.config import data_dir as default_data_dir

ANONYMOUS = "-"  # the routers' name for a request that came with no key (messages.usage.ANONYMOUS_CALLER)


def _ms(ms: float) -> str:
    return "-" if ms < 0 else f"{ms:,.1f} ms"


def describe(line: m.AccessLine, path: Path) -> list[str]:
    """The lines a person reads for one request."""
    who = "anonymous" if line.caller == ANONYMOUS else line.caller + (f" (tenant {line.tenant})" if line.tenant else "")
    said = f"{line.status}" + (f" {line.error}" if line.error else "") + (" streamed" if line.stream else "")
    return [
        f"request {line.id}  at {line.at:%Y-%m-%d %H:%M:%S.%f}"[:-3] + f" UTC  router {line.router or '-'}",
        f"  {line.route}  model {line.model or '-'}  replica {line.replica or '-'}  status {said}",
        f"  key {who}",
        f"  tokens: {line.prompt_tokens:,} prompt ({line.cached_tokens:,} cached), {line.completion_tokens:,} completion",
        f"  times: queue {_ms(line.queue_ms)}, wake {_ms(line.wake_ms)}, first byte {_ms(line.ttft_ms)}, "
        f"total {_ms(line.total_ms)}",
        f"  in {path}",
    ]


@click.command("request")
@click.argument("request_id", metavar="ID")
@click.option("--log", "logs", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              help="An access log to search (a router's --access-log FILE), repeatable [default: every "
                   "*access*.log* in <data dir>/logs/, rotated and gzipped ones too].")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None, envvar="LLMGW_DATA_DIR",
              help="The data directory `llmgw up --data-dir` used [env LLMGW_DATA_DIR].")
@json_option
def request(request_id: str, logs: tuple[Path, ...], data_dir: Path | None, as_json: bool) -> None:
    """One request by its id (an answer's x-request-id): who asked, which replica, status, tokens, times.

    Searches the access logs of the data directory, newest first (`llmgw up`
    writes `logs/router-access.log`), or the files --log names; prints every
    line with that id.

    Example:

    \b
        llmgw ctl request 4f1c0e9a2b7d4c1e8f3a5b6c7d8e9f01
        llmgw ctl request my-trace-42 --log /var/log/llmgw/router-access.log --json
    """
    from llmgw import ctl

    root = data_dir or default_data_dir()
    paths = list(logs) or ctl.access_logs(root)
    if not paths:
        raise click.ClickException(f"no access log in {root / 'logs'} (`llmgw up` writes router-access.log there); "
                                   "give --data-dir DIR, or --log FILE for a router started with --access-log FILE")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise click.ClickException(f"no access log at {', '.join(missing)}; give --log the file a router's "
                                   "--access-log names")
    found = ctl.find_request(request_id, paths)
    if not found:
        raise click.ClickException(
            f"no request {request_id} in {len(paths)} access log{'s' if len(paths) != 1 else ''} "
            f"({', '.join(str(p) for p in paths[:3])}{', …' if len(paths) > 3 else ''}); a router logs only with "
            "--access-log (`llmgw up`: <data dir>/logs/router-access.log), and only what it answered")
    if as_json:
        echo_json([{**msgspec.to_builtins(line), "file": str(path)} for path, line in found])
        return
    for i, (path, line) in enumerate(found):
        if i:
            click.echo()
        click.echo("\n".join(describe(line, path)))
