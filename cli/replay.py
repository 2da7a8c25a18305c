"""``llmgw replay``: the history streams as a readable timeline (or JSON lines) for debugging."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, NamedTuple

import click
import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.cli.options import json_option, nats_options, run
from llmgw.cli.progress import parse_time, progress
from llmgw.cli.status import parse_stream
from llmgw.config import Settings
from llmgw.projections.runner import DECODERS


class Entry(NamedTuple):
    """One stored message, decoded when it could be."""

    at: datetime
    stream: str
    seq: int
    subject: str
    stored_at: datetime
    event: m.Event | None
    raw: bytes
    error: str


def involves_node(event: m.Event, node: str) -> bool:
    if getattr(event, "node", None) == node:
        return True
    if node in getattr(event, "nodes", ()):
        return True
    return any(g.node == node for g in getattr(event, "gpus", ()) if isinstance(g, m.GpuRef))


def involves_model(event: m.Event, model: str) -> bool:
    if isinstance(event, m.ModelDeclared):
        return event.spec.name == model
    if isinstance(event, m.IdleMapPublished):
        return False
    return model in (getattr(event, "model", None), getattr(event, "name", None))


async def read_entries(settings: Settings, streams: tuple[str, ...], subject: str | None,
                       since: datetime | None, until: datetime | None, node: str | None,
                       model: str | None) -> list[Entry]:
    """Every stored message that passes the filters, in event-time order."""
    bus = await Bus.connect(settings, "llmgw-replay", reconnect=False)
    out: list[Entry] = []
    try:
        stops = {s: await bus.stream_last_seq(s) for s in streams}
        total = sum(stops.values())
        done = 0
        with progress("reading") as on_progress:
            for stream, last in stops.items():
                if last == 0:
                    continue
                reader = bus.reader(stream, 1, stop_at=last, filter_subjects=[subject] if subject else [])
                async with contextlib.aclosing(reader.batches()) as batches:  # type: ignore[type-var]
                    async for msgs in batches:
                        for x in msgs:
                            out.extend(_entry(stream, x.seq, x.subject, x.data, x.ts_ns, since, until, node, model))
                        done += len(msgs)
                        if on_progress is not None:
                            on_progress(done, total)
    finally:
        await bus.close()
    out.sort(key=lambda e: (e.at, e.stream, e.seq))
    return out


def _entry(stream: str, seq: int, subject: str, data: bytes, ts_ns: int, since: datetime | None,
           until: datetime | None, node: str | None, model: str | None) -> Iterator[Entry]:
    stored = datetime.fromtimestamp(ts_ns / 1e9, UTC)
    try:
        event: m.Event | None = DECODERS[stream].decode(data)
        error = ""
    except m.DECODE_ERRORS as e:
        event, error = None, str(e) or type(e).__name__
    at = event.at if event is not None else stored
    if (since and at < since) or (until and at > until):
        return
    if event is None:
        if not node and not model:
            yield Entry(at, stream, seq, subject, stored, None, data, error)
        return
    if node and not involves_node(event, node):
        return
    if model and not involves_model(event, model):
        return
    yield Entry(at, stream, seq, subject, stored, event, data, "")


def describe(event: m.Event) -> str:
    """One line a person can read: what happened, with the numbers."""
    match event:
        case m.NodeInventoryReported():
            bad = [str(g.index) for g in event.gpus if not g.healthy]
            classes = ",".join(sorted({g.gpu_class for g in event.gpus})) or "-"
            extra = f", unhealthy: {' '.join(bad)}" if bad else ""
            return f"node {event.node} reported {len(event.gpus)} × {classes} on fabric {event.fabric}{extra}"
        case m.GpuHealthChanged():
            word = "healthy again" if event.healthy else "UNHEALTHY"
            why = f" ({', '.join(event.reasons)})" if event.reasons else ""
            return f"node {event.node} GPU {event.gpu_index} {word}{why}"
        case m.NodeLost():
            return f"node {event.node} LOST (no heartbeat for {event.timeout_s:.0f}s)"
        case m.NodeReturned():
            return f"node {event.node} returned"
        case m.ModelDeclared(spec=s):
            return (f"model {s.name} declared: {s.replicas} × {s.gpu_class} tp{s.tp} pp{s.pp} "
                    f"{s.precision} ({s.engine})")
        case m.ModelScaled():
            return f"model {event.name} scaled to {event.replicas} replicas"
        case m.ModelAutoscaled():
            return f"model {event.name} autoscaled to {event.replicas} replicas: {event.reason}"
        case m.ModelWanted():
            return (f"router {event.router} wants model {event.model}: {event.waiting} request"
                    f"{'s' if event.waiting != 1 else ''} waiting (it had seen control up to #{event.control_seq})")
        case m.ModelRemoved():
            return f"model {event.name} removed"
        case m.ModelUnplaceable():
            return f"model {event.name} UNPLACEABLE ({event.missing_replicas} missing): {event.reason}"
        case m.ReplicaPlaced():
            why = f" ({event.reason})" if event.reason else ""
            return (f"replica {event.replica_id} of {event.model} placed on {','.join(event.nodes)} "
                    f"({len(event.gpus)} GPUs, fabric {event.fabric or '-'}){why}")
        case m.ReplicaStateChanged():
            detail = f": {event.detail}" if event.detail else ""
            return f"replica {event.replica_id} of {event.model} on {event.node} is {event.state}{detail}"
        case m.ReplicaStopped():
            return f"replica {event.replica_id} of {event.model} stopped: {event.reason}"
        case m.IdleMapPublished():
            return (f"router {event.router} tick {event.tick}: {len(event.last_request)} replicas with requests, "
                    f"{len(event.serving_since)} without since routing began")
    return type(event).__name__


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
    entries = run(read_entries(settings, streams, subject, since, until, node, model))
    for e in entries:
        if as_json:
            click.echo(json.dumps(entry_json(e), default=str))
        else:
            where = f"{e.stream.removeprefix('LLMGW_').lower()}:{e.seq}"
            what = describe(e.event) if e.event is not None else f"UNDECODABLE on {e.subject}: {e.error}"
            click.echo(f"{e.at:%Y-%m-%d %H:%M:%S}  {where:<14}  {what}")
    if not entries and not as_json:
        click.echo("no events match; widen --since/--until or drop a filter", err=True)
