"""``llmgw ctl status``: the fleet at a glance, from the projector or by replaying the streams."""

from __future__ import annotations

import io
from collections import Counter
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import click
import msgspec

if TYPE_CHECKING:
    from rich.console import Console

from llmgw import messages as m
from llmgw import subjects
from llmgw.cli.options import json_option, nats_options, run
from llmgw.cli.progress import human_duration, now_or, parse_duration, parse_time, progress
from llmgw.config import Settings

BAR_WIDTH = 20


def parse_stream(text: str, flag: str) -> str:
    """A history stream from ``fleet``, ``control``, ``usage`` or its full name."""
    name = text.strip().upper()
    name = name if name.startswith("LLMGW_") else f"LLMGW_{name}"
    if name not in subjects.HISTORY_STREAMS:
        raise click.BadParameter(
            f"{text!r} is not a history stream; use one of fleet, control, usage", param_hint=flag
        )
    return name


def parse_at_seq(text: str) -> tuple[str, int]:
    """``STREAM:SEQ``: that stream up to SEQ, the others up to the moment SEQ was stored."""
    stream, sep, seq = text.rpartition(":")
    if not sep or not seq.isdigit() or int(seq) < 1:
        raise click.BadParameter(f"{text!r} is not STREAM:SEQ, e.g. fleet:1200 or control:42", param_hint="--at-seq")
    return parse_stream(stream, "--at-seq"), int(seq)


EARLIEST_AT = datetime(2000, 1, 1, tzinfo=UTC)  # before any llmgw history: a typo, not a question


def check_at(at: datetime, text: str, now: datetime | None = None) -> datetime:
    """``--at`` a moment the history can answer: not in the future (give or take the clock skew events
    may have, fold.MAX_AHEAD), not before 2000. The streams' own start is checked where they are read."""
    from llmgw.fleet import MAX_AHEAD

    now = now_or(now)
    if at > now + MAX_AHEAD:
        raise click.ClickException(
            f"--at {text} is {human_duration((at - now).total_seconds())} in the future (now is "
            f"{now:%Y-%m-%d %H:%M:%S} UTC); status shows what was, not what will be: give a past time like "
            "2026-03-02T10:42 or 2h (two hours ago), or leave --at out for the fleet now")
    if at < EARLIEST_AT:
        raise click.ClickException(
            f"--at {text} is before 2000, long before any llmgw history; give a time since the first event "
            "(`llmgw replay --stream fleet` lists them from the first) or a duration ago like 2h")
    return at


def usage_bar(c: m.ClassCapacity, width: int = BAR_WIDTH) -> str:
    """Used ``█``, free ``░``, unhealthy ``x``, lost ``?``, scaled to ``width``.

    A kind that is there gets at least one cell (1 used GPU of 40 is not an
    empty bar); the cells that takes come from the kind with the most.
    """
    if c.total == 0:
        return ""
    counts = [c.used, c.free, c.unhealthy, c.lost]
    cells = [max(round(n * width / c.total), 1 if n else 0) for n in counts]
    while sum(cells) > width:
        # Free first among equals: rounding lands on free.
        most = max((1, 0, 2, 3), key=lambda k: (cells[k] > 1, cells[k]))
        cells[most] -= 1
    if sum(cells) < width:
        cells[1 if counts[1] else max(range(4), key=lambda k: counts[k])] += width - sum(cells)
    return "".join(ch * n for ch, n in zip("█░x?", cells, strict=True))


def plural(n: int, word: str) -> str:
    """``1 replica``, ``2 replicas``: counts read right."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def _time(t: datetime | None) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def gib(mib: int) -> str:
    """MiB as GiB for a table: ``79.6``, ``1,274.4``."""
    return f"{mib / 1024:,.1f}"


def util_cell(u: m.ClassGpuUse | None) -> str:
    """Mean utilization of a class's sampled GPUs: ``63%``; ``-`` when none reports it (or a replay)."""
    return "-" if u is None or not u.sampled or u.utilization_pct is None else f"{u.utilization_pct:.0f}%"


def used_cell(c: m.ClassCapacity, u: m.ClassGpuUse | None) -> str:
    """Memory in use on a class's GPUs: NVML's latest samples where the agents sent some (live only), else
    what the replicas' engines report holding (folded, so a replay has it too); ``-`` when neither says."""
    if u is not None and u.sampled and u.memory_total_mib:
        return f"{gib(u.memory_used_mib)} (nvml)"
    return "-" if c.used_mib is None else f"{gib(c.used_mib)} (engines)"


def render_memory(r: m.StatusReport, console: Console) -> None:
    """Per class, the memory of its usable GPUs: booked by replicas, in use, left."""
    from rich import box
    from rich.table import Table

    console.print("Memory  (GiB of the healthy GPUs on live nodes: a GPU holds replicas while their bookings fit)")
    table = Table(box=box.SIMPLE)
    for col in ("GPU class", "memory", "booked", "used", "free", "most free on one GPU"):
        table.add_column(col, justify="left" if col == "GPU class" else "right")
    use = {u.gpu_class: u for u in r.gpu_use}
    for c in r.capacity:
        table.add_row(c.gpu_class, gib(c.memory_mib), gib(c.booked_mib), used_cell(c, use.get(c.gpu_class)),
                      gib(c.free_mib), gib(c.most_free_mib))
    console.print(table)


def render_bookings(r: m.StatusReport, console: Console) -> None:
    """Every GPU some replica holds: how much of it is booked, and by whom."""
    from rich import box
    from rich.table import Table

    if not r.gpu_bookings:
        return
    console.print("GPUs held  (GiB booked of each card, and by which replicas)")
    table = Table(box=box.SIMPLE)
    for col in ("GPU", "GPU class", "booked", "replicas"):
        table.add_column(col, justify="right" if col == "booked" else "left", overflow="fold")
    for b in r.gpu_bookings:
        card = f" of {gib(b.memory_mib)}" if b.memory_mib else ""
        table.add_row(f"{b.node}:{b.index}", b.gpu_class or "-", f"{gib(b.booked_mib)}{card}",
                      ", ".join(f"{rid} {gib(mib)}" for rid, mib in b.replicas))
    console.print(table)


def render_replicas(r: m.StatusReport, console: Console) -> None:
    """Every replica: where it runs and how it is doing."""
    from rich import box
    from rich.table import Table

    from llmgw.cli.models import gpu_ranges  # the model commands' module: only tables need it

    console.print(f"Replicas ({len(r.replica_list)}; idle - = no router knows)")
    if not r.replica_list:
        console.print("  none placed\n")
        return
    table = Table(box=box.SIMPLE)
    for col in ("replica", "model", "state", "GPUs", "fabric", "endpoint", "restarts", "idle"):
        table.add_column(col, justify="right" if col in ("restarts", "idle") else "left")
    for x in r.replica_list:
        table.add_row(x.replica_id, x.model, x.state, gpu_ranges(x.gpus), x.fabric or "-", x.endpoint or "-",
                      str(x.restarts), human_duration(x.idle_s))
    console.print(table)
    render_bookings(r, console)


def render(r: m.StatusReport, console: Console, limit: int, replicas: bool = False) -> None:
    """The report as tables for people."""
    from rich import box
    from rich.table import Table

    lost = f" ({len(r.lost_nodes)} lost: {', '.join(r.lost_nodes)})" if r.lost_nodes else ""
    states = ", ".join(f"{n} {s}" for s, n in r.replicas_by_state.items())
    positions = " ".join(f"{k.removeprefix('LLMGW_').lower()}:{v}" for k, v in r.positions.items())
    console.print(f"Fleet at {_time(r.now)} UTC  [{positions or 'no events'}]")
    console.print(
        f"{plural(r.nodes, 'node')}{lost} · {plural(r.models, 'model')} · {plural(r.replicas, 'replica')}"
        f"{f' ({states})' if states else ''} · {plural(r.unprojected_events, 'unprojected event')}"
        f"{f' · {r.clamped_events} folded at their store time (clock off)' if r.clamped_events else ''}",
    )
    if r.control_plane == "down":
        console.print(f"CONTROL PLANE DOWN since {_time(r.control_plane_since)} UTC (`llmgw up` stopped): no "
                      "replica serves and no GPU-hours count while it is down")
    for node, why in r.cordoned.items():
        console.print(f"node {node}: {why} (nothing new is placed on it; `llmgw ctl node uncordon {node}`)")
    for node, faults in r.gpu_faults.items():
        console.print(f"node {node}: {plural(faults, 'GPU fault')} in 24h (placement prefers nodes with fewer)")
    if r.model_states:
        counts = Counter(r.model_states.values())
        order = ("serving", "starting", "failing", "parked", "unplaceable", "stopped", "down")
        console.print("models: " + ", ".join(
            f"{counts[k]} {k} ({', '.join(n for n, v in r.model_states.items() if v == k)})" for k in order if counts[k]))
    if r.model_list:
        console.print("\nModels  (replicas healthy/wanted; idle: since anyone asked, - = no router knows)")
        models = Table(box=box.SIMPLE)
        files = any(s.files_nodes >= 0 for s in r.model_list)  # some agent reports its disk (--keep-files)
        cols = ("model", "state", "replicas", "per replica", "GPUs held", "idle", *(("files on",) if files else ()))
        for col in cols:
            models.add_column(col, justify="right" if col in ("replicas", "GPUs held", "idle", "files on") else "left")
        for s in r.model_list[:limit]:
            models.add_row(s.name, s.state, f"{s.healthy}/{s.wanted}",
                           f"{s.gpus_per_replica} × {s.gpu_class} ({s.precision}, {plural(s.pp, 'node')})",
                           str(s.gpus_held), human_duration(s.idle_s),
                           *((plural(s.files_nodes, 'node') if s.files_nodes >= 0 else "-",) if files else ()))
        console.print(models)
        for s in r.model_list:
            for fetch in s.fetching:  # downloads in flight, as their agents last reported them
                share = fetch.done / fetch.total if fetch.total else 0.0
                bar = "█" * round(share * 20) + "░" * (20 - round(share * 20))
                console.print(f"downloading {s.name} on {fetch.node}: {bar} {share:.0%} of "
                              f"{fetch.total / (1 << 30):.2f} GiB at {fetch.rate / (1 << 20):.1f} MiB/s")
        if len(r.model_list) > limit:
            console.print(f"… and {len(r.model_list) - limit} more (--limit, `llmgw ctl model list`, or --json)\n")
    else:
        console.print()
    console.print("Capacity  (whole GPUs: █ holding a replica  ░ free  x unhealthy  ? lost)")
    cap = Table(box=box.SIMPLE)
    for col in ("GPU class", "total", "used", "free", "unhealthy", "lost"):
        cap.add_column(col, justify="left" if col == "GPU class" else "right")
    cap.add_column("usage")
    # What the GPUs are doing, from the agents' latest NVML samples (live only; a replay has none).
    use = {u.gpu_class: u for u in r.gpu_use}
    if use:
        cap.add_column("util", justify="right")
    for c in r.capacity:
        row = [c.gpu_class, str(c.total), str(c.used), str(c.free), str(c.unhealthy), str(c.lost), usage_bar(c)]
        if use:
            row.append(util_cell(use.get(c.gpu_class)))
        cap.add_row(*row)
    console.print(cap)
    render_memory(r, console)
    console.print("Free whole nodes (every GPU healthy and free; what a multi-node replica needs)")
    fab = Table(box=box.SIMPLE)
    for col in ("fabric", "GPU class", "free", "live"):
        fab.add_column(col, justify="right" if col in ("free", "live") else "left")
    for f in r.free_nodes:
        fab.add_row(f.fabric, f.gpu_class, str(f.free_nodes), str(f.live_nodes))
    console.print(fab)
    if r.unplaceable:
        console.print("Unplaceable models")
        un = Table(box=box.SIMPLE)
        for col in ("model", "since", "reason"):
            un.add_column(col, overflow="fold")
        for u in r.unplaceable:
            un.add_row(u.name, _time(u.since), u.reason)
        console.print(un)
    failing = [s for s in r.model_list if s.state == "failing"]
    if failing:
        console.print("Failing models (their engines fail to start; the last error line an agent reported)")
        fail = Table(box=box.SIMPLE)
        for col in ("model", "since", "error"):
            fail.add_column(col, overflow="fold")
        for s in failing:
            fail.add_row(s.name, _time(s.failure_at), s.failure or "(no output)")
        console.print(fail)
    if replicas:
        render_replicas(r, console)
    console.print(f"Replicas nobody asked for (idle ≥ {human_duration(r.idle_threshold_s)}; - = no router knows)")
    if not r.idle:
        console.print("  none")
        return
    idle = Table(box=box.SIMPLE)
    for col in ("replica", "model", "GPUs", "nodes", "state", "idle"):
        idle.add_column(col, justify="right" if col in ("GPUs", "idle") else "left")
    for i in r.idle[:limit]:
        idle.add_row(i.replica_id, i.model, str(i.gpus), ",".join(i.nodes), i.state, human_duration(i.idle_s))
    console.print(idle)
    if len(r.idle) > limit:
        console.print(f"… and {len(r.idle) - limit} more (--limit, or --json for all)")


@click.command()
@nats_options
@json_option
@click.option("--replay", "use_replay", is_flag=True, help="Fold the streams here instead of asking the projector.")
@click.option("--at", "at_text", metavar="TIME", help="The fleet as it was then (ISO 8601, UTC unless an offset; or 2h for two hours ago). Implies --replay.")
@click.option("--at-seq", "at_seq_text", metavar="STREAM:SEQ", help="Right after that message: STREAM up to SEQ, the other streams up to when it was stored. Implies --replay.")
@click.option("--idle-threshold", default="30m", show_default=True, help="List replicas without a request for this long.")
@click.option("--limit", default=20, show_default=True, help="Rows of models and of idle replicas in the tables.")
@click.option("--replicas", "show_replicas", is_flag=True, help="Also every replica: GPUs, fabric, endpoint, state, idle.")
@click.option("--no-snapshot", is_flag=True, help="With --replay/--at: fold from sequence 1, not from the newest fold snapshot.")
def status(settings: Settings, as_json: bool, use_replay: bool, at_text: str | None, at_seq_text: str | None,
           idle_threshold: str, limit: int, show_replicas: bool, no_snapshot: bool) -> None:
    """Show capacity, free nodes, models, unplaceable models and idle replicas.

    Example:

        llmgw ctl status
        llmgw ctl status --replicas
        llmgw ctl status --at 2026-03-02T10:42 --idle-threshold 1h --json
    """
    if at_text and at_seq_text:
        raise click.UsageError("give --at or --at-seq, not both")
    threshold_s = parse_duration(idle_threshold, "--idle-threshold")
    at = check_at(parse_time(at_text, "--at"), at_text) if at_text else None
    at_seq = parse_at_seq(at_seq_text) if at_seq_text else None
    replay = use_replay or at is not None or at_seq is not None
    from llmgw import ctl

    if replay:
        with progress("replaying") as on_progress:
            r = run(ctl.fetch_status(settings, threshold_s, replay=True, at=at, at_seq=at_seq, progress=on_progress,
                                     replicas=show_replicas, use_snapshots=not no_snapshot,
                                     notice=lambda line: click.echo(line, err=True)))
    else:
        r = ctl.ask_status(settings, threshold_s, replicas=show_replicas)  # one question: no event loop, no nats-py
    if as_json:
        click.echo(msgspec.json.format(m.encode(r), indent=2).decode())
        return
    from rich.console import Console

    terminal = Console().is_terminal
    buf = io.StringIO()
    render(r, Console(file=buf, highlight=False, markup=False, width=Console().width if terminal else 120,
                      force_terminal=terminal), limit, show_replicas)
    click.echo("\n".join(line.rstrip() for line in buf.getvalue().splitlines()).rstrip("\n"))
