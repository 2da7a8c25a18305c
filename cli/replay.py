"""``llmgw replay``: the history streams as a readable timeline (or JSON lines) for debugging."""

from __future__ import annotations

import json
from typing import Any

import click
import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.cli.options import json_option, nats_options, run
from llmgw.cli.progress import parse_time, progress
from llmgw.cli.status import parse_stream
from llmgw.config import Settings
from llmgw.ctl import Entry


def entry_json(e: Entry) -> dict[str, Any]:
    row: dict[str, Any] = {"stream": e.stream, "seq": e.seq, "subject": e.subject,
                           "stored_at": e.stored_at.isoformat()}
    if e.event is None:
        row.update(error=e.error, raw=e.raw.decode("utf-8", "replace"))
    else:
        row["event"] = msgspec.to_builtins(e.event)
    return row


@click.command()
@nats_options
@json_option
@click.option("--stream", "stream_text", help="Only this stream: fleet, control or usage.")
@click.option("--subject", help="Only subjects matching this NATS filter, e.g. 'llmgw.control.model.>'.")
@click.option("--since", "since_text", metavar="TIME", help="Events at or after (ISO 8601, UTC unless an offset; or 2h ago).")
@click.option("--until", "until_text", metavar="TIME", help="Events at or before.")
@click.option("--node", help="Only events about this node (its GPUs and the replicas placed on it).")
@click.option("--model", help="Only events about this model and its replicas.")
def replay(settings: Settings, as_json: bool, stream_text: str | None, subject: str | None,
           since_text: str | None, until_text: str | None, node: str | None, model: str | None) -> None:
    """Print the stored history as a timeline, oldest first.

    Example:

        llmgw replay --model Qwen2.5-72B --since 2026-03-02T10:00 --until 2026-03-02T11:00
        llmgw replay --node h100-a-03 --json | jq .event.type
    """
    if stream_text:
        streams: tuple[str, ...] = (parse_stream(stream_text, "--stream"),)
    elif subject:
        try:
            streams = (subjects.stream_for_subject(subject),)
        except ValueError:
            raise click.BadParameter(f"{subject!r} is not an llmgw subject; start it with llmgw.fleet., "
                                     "llmgw.control. or llmgw.usage.", param_hint="--subject") from None
        if streams[0] not in subjects.HISTORY_STREAMS:
            raise click.BadParameter("heartbeats are not history; pick a fleet, control or usage subject",
                                     param_hint="--subject")
    else:
        streams = subjects.HISTORY_STREAMS
    since = parse_time(since_text, "--since") if since_text else None
    until = parse_time(until_text, "--until") if until_text else None
    from llmgw import ctl

    with progress("reading") as on_progress:
        entries = run(ctl.read_entries(settings, streams, subject, since, until, node, model, on_progress))
    for e in entries:
        if as_json:
            click.echo(json.dumps(entry_json(e), default=str))
        else:
            where = f"{e.stream.removeprefix('LLMGW_').lower()}:{e.seq}"
            what = m.describe(e.event) if e.event is not None else f"UNDECODABLE on {e.subject}: {e.error}"
            click.echo(f"{e.at:%Y-%m-%d %H:%M:%S}  {where:<14}  {what}")
    if not entries and not as_json:
        click.echo("no events match; widen --since/--until or drop a filter", err=True)
