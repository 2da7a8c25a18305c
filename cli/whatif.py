"""``llmgw ctl what-if``: replay a window of history under another policy, beside what happened."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path

import click
import msgspec

from llmgw.cli.options import json_option, nats_options, run
from llmgw.cli.progress import MAX_DURATION_S, human_duration, parse_duration, parse_time, progress
from llmgw.config import Settings
from llmgw.whatif import Policy

FIGURES = (("gpu_hours", "GPU-hours held"), ("booked_gib_hours", "GiB-hours booked"),
           ("idle_gpu_hours", "GPU-hours idle"), ("cold_starts", "cold starts"),
           ("waited_requests", "requests that waited"), ("added_wait_s_p50", "added wait p50 (s)"),
           ("added_wait_s_p95", "added wait p95 (s)"), ("unplaceable_minutes", "minutes unplaceable"),
           ("replicas_placed", "replicas placed"))
PACKING, WHOLE = "packing", "whole GPUs"


def _ttl(text: str, flag: str) -> float | None:
    if text.strip().lower() in ("never", "off", "none"):
        return None
    seconds = parse_duration(text, flag)
    if seconds <= 0:
        raise click.BadParameter(f"{text!r}: an idle TTL of 0 stops nothing (the scheduler reads 0 as unset); "
                                 "write `never` for no idle stops, or a duration such as 15m", param_hint=flag)
    if seconds >= MAX_DURATION_S:
        raise click.BadParameter(f"{text!r}: ten years is no TTL; write `never`", param_hint=flag)
    return seconds


def pack_policies(ttls: tuple[str, ...], min_replicas: int | None, max_replicas: int | None,
                  target: float | None, models: tuple[str, ...]) -> list[Policy]:
    """``--pack``: the scheduler's placement (replicas share cards by memory) beside whole GPUs alone."""
    asked = [flag for flag, v in (("--idle-ttl", ttls), ("--min-replicas", min_replicas),
                                  ("--max-replicas", max_replicas), ("--target-in-flight", target))
             if v not in (None, ())]
    if asked:
        raise click.UsageError(f"--pack compares placement alone, under the recorded knobs; ask {', '.join(asked)} "
                               "in another what-if")
    chosen = frozenset(models)
    return [Policy(label=PACKING, models=chosen), Policy(label=WHOLE, models=chosen, exclusive=True)]


def policies_from(ttls: tuple[str, ...], min_replicas: int | None, max_replicas: int | None,
                  target: float | None, models: tuple[str, ...]) -> list[Policy]:
    """One policy per value of the one --idle-ttl that lists several (a sweep), else one."""
    fixed: list[tuple[str, float | None]] = []
    sweep: tuple[str, list[tuple[str, float | None]]] | None = None
    for text in ttls:
        name, _, given = text.rpartition("=")
        if name and name not in models and models:
            raise click.BadParameter(f"{text!r} names {name!r}, which is not among --model {', '.join(models)}",
                                     param_hint="--idle-ttl")
        parts = [v for v in given.split(",") if v.strip()]
        if not parts:
            raise click.BadParameter(f"{text!r} gives no duration", param_hint="--idle-ttl")
        parsed = [(v.strip(), _ttl(v, "--idle-ttl")) for v in parts]
        if len(parsed) > 1:
            if sweep is not None:
                raise click.BadParameter("only one --idle-ttl may list several values (the sweep)",
                                         param_hint="--idle-ttl")
            sweep = (name, parsed)
        else:
            fixed.append((name, parsed[0][1]))
    knobs = [f"min {min_replicas}" if min_replicas is not None else "",
             f"max {max_replicas}" if max_replicas is not None else "",
             f"target {target:g}" if target is not None else ""]
    if min_replicas is not None and max_replicas is not None and min_replicas > max_replicas:
        raise click.BadParameter(f"--min-replicas {min_replicas} is more than --max-replicas {max_replicas}",
                                 param_hint="--min-replicas")

    def label(ttl: list[tuple[str, str]]) -> str:
        parts = [f"idle-ttl {f'{n}=' if n else ''}{v}" for n, v in ttl] + [k for k in knobs if k]
        return ", ".join(parts) or "recorded knobs"

    shown = [(n, text.rpartition("=")[2]) for text in ttls if "," not in text for n in [text.rpartition("=")[0]]]
    common = dict(min_replicas=min_replicas, max_replicas=max_replicas, target_in_flight=target,
                  models=frozenset(models))
    if sweep is None:
        if not fixed and not any(knobs):
            raise click.UsageError("ask something: --idle-ttl, --min-replicas, --max-replicas, --target-in-flight "
                                   "or --pack")
        return [Policy(label=label(shown), idle_ttl=tuple(fixed), **common)]  # type: ignore[arg-type]
    swept, values = sweep
    return [Policy(label=label([*shown, (swept, v)]), idle_ttl=(*fixed, (swept, ttl)), **common)  # type: ignore[arg-type]
            for v, ttl in values]


def _cell(value: float | int | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.2f}"


@click.command("what-if")
@click.option("--since", default="7d", show_default=True,
              help="Start of the window: ISO 8601 (UTC unless an offset) or a duration ago (7d).")
@click.option("--until", default=None, help="End of the window (default: now).")
@click.option("--model", "models", multiple=True, help="Only these models (repeat); the policy changes only them.")
@click.option("--idle-ttl", "ttls", multiple=True, metavar="[MODEL=]DURATION[,…]",
              help="Idle TTL to try: 15m, never, coder=5m; a list (5m,15m,1h,never) is a sweep.")
@click.option("--min-replicas", type=click.IntRange(0, 10_000), default=None, help="Autoscale from this many.")
@click.option("--max-replicas", type=click.IntRange(1, 10_000), default=None, help="Autoscale up to this many.")
@click.option("--target-in-flight", type=click.FloatRange(0, 100_000, min_open=True), default=None,
              help="Requests in flight per replica the autoscaler aims at.")
@click.option("--pack", is_flag=True,
              help="Packing (replicas share cards by memory) beside whole GPUs alone (every model --exclusive).")
@click.option("--fleet", "fleet_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A fleet file whose nodes the asked policy has besides the recorded fleet.")
@click.option("--no-snapshot", is_flag=True, help="Fold from sequence 1 instead of the newest fold snapshot.")
@json_option
@nats_options
def what_if(since: str, until: str | None, models: tuple[str, ...], ttls: tuple[str, ...], min_replicas: int | None,
            max_replicas: int | None, target_in_flight: float | None, pack: bool, fleet_file: Path | None,
            no_snapshot: bool, as_json: bool, settings: Settings) -> None:
    """What the recorded history would have cost under another policy, beside what it cost.

    Example:

        llmgw ctl what-if --since 7d --idle-ttl 15m
        llmgw ctl what-if --since 7d --model coder --idle-ttl 5m,15m,1h,never
        llmgw ctl what-if --since 2026-03-02 --until 2026-03-09 --min-replicas 1 --max-replicas 4 --json
        llmgw ctl what-if --since 7d --pack
    """
    from llmgw import ctl
    from llmgw.whatif import what_if as run_what_if

    now = datetime.now(UTC)
    start = parse_time(since, "--since", now)
    end = parse_time(until, "--until", now) if until else now
    if end > now:
        raise click.BadParameter(f"{until!r} is in the future; the history ends now", param_hint="--until")
    policies = (pack_policies if pack else policies_from)(ttls, min_replicas, max_replicas, target_in_flight, models)
    extra: tuple = ()
    if fleet_file is not None:
        from llmgw import fleetfile

        extra = tuple(fleetfile.inventories(fleetfile.load(fleet_file), start))

    async def go() -> object:
        bus = await ctl.connect(settings, "llmgw-ctl-what-if")
        try:
            with progress("what-if") as tick:
                return await run_what_if(bus, since=start, until=end, policies=policies, models=models, extra=extra,
                                         progress=tick, use_snapshots=not no_snapshot,
                                         warn=lambda line: click.echo(line, err=True))
        finally:
            await bus.close()

    report = run(go())
    if as_json:
        click.echo(msgspec.json.format(msgspec.json.encode(report), indent=2).decode())
        return
    from llmgw.cli.models import echo_rendered

    echo_rendered(lambda console: render(report, console, chart=sys.stdout.isatty()))


def render(report: object, console: object, chart: bool = False) -> None:
    """The answer for people: fidelity first, then recorded beside asked, per model, and a chart for a sweep."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from llmgw.whatif import WhatIfReport

    assert isinstance(report, WhatIfReport) and isinstance(console, Console)
    f = report.fidelity
    if not f.trusted:
        console.print(f"WARNING: the recorded policy re-decided reproduces only {f.reproduced:.1%} of what "
                      "happened (under 95 %): the figures below cannot be trusted.")
    span = human_duration((report.until - report.since).total_seconds())
    scope = ", ".join(report.models) if report.models else "every model"
    console.print(f"What if, {report.since:%Y-%m-%d %H:%M} → {report.until:%Y-%m-%d %H:%M} UTC ({span}, "
                  f"{report.events:,} events), {scope}")
    diff = "-" if f.gpu_hours_diff is None else f"{f.gpu_hours_diff:+.1%}"
    console.print(f"fidelity: {f.reproduced:.1%} of {f.recorded_decisions:,} recorded placements and stops "
                  f"reproduced (same model, within a minute); GPU-hours {f.gpu_hours_replayed:,.2f} replayed vs "
                  f"{f.gpu_hours_recorded:,.2f} recorded ({diff}); goal ≥ 99 % and ±2 %")
    for note in report.notes:
        console.print(f"note: {note}")
    table = Table(box=box.SIMPLE)
    table.add_column("")
    table.add_column("recorded", justify="right")
    for a in report.asked:
        table.add_column(a.policy, justify="right")
    for key, name in FIGURES:
        table.add_row(name, _cell(getattr(report.recorded.total, key)),
                      *(_cell(getattr(a.total, key)) for a in report.asked))
    console.print(table)
    pack = [a.policy for a in report.asked] == [PACKING, WHOLE]
    if len(report.asked) > 1 and chart and not pack:
        _chart(report, console)
    names = sorted(report.recorded.models)
    if len(names) > 1 or report.models:
        what = "GPU-h held / GiB-h booked / min unplaceable" if pack else \
            "GPU-hours held / cold starts / requests that waited"
        per = Table(box=box.SIMPLE, title=f"Per model: {what}")
        per.add_column("model")
        per.add_column("recorded", justify="right")
        for a in report.asked:
            per.add_column(a.policy, justify="right")
        for name in names:
            cells = [report.recorded.models.get(name), *(a.models.get(name) for a in report.asked)]
            per.add_row(name, *("-" if c is None else
                                f"{c.gpu_hours:,.1f} / {c.booked_gib_hours:,.0f} / {c.unplaceable_minutes:,.0f}" if pack
                                else f"{c.gpu_hours:,.1f} / {c.cold_starts} / {c.waited_requests}" for c in cells))
        console.print(per)
    if pack:
        console.print("GPU-hours count a card once while any replica books it; GiB-hours booked count what each "
                      "replica booked on it (whole GPUs: the whole card)")
    by: dict[tuple[float, str], list[str]] = {}
    for k, v in sorted(report.engine_start.items()):
        by.setdefault((v.healthy_s, v.source), []).append(k)
    if by:
        parts = [f"{', '.join(ns) if len(ns) <= 4 else f'{len(ns)} models'} {h:g}s ({src})" for (h, src), ns in by.items()]
        console.print(f"engine start-up used (placed → healthy, from the ledger): {'; '.join(parts)}")


def _chart(report: object, console: object) -> None:
    """GPU-hours against cold starts, one bar pair per swept value: the trade-off at a glance."""
    from rich.console import Console

    from llmgw.whatif import WhatIfReport

    assert isinstance(report, WhatIfReport) and isinstance(console, Console)
    rows = [("recorded", report.recorded.total), *((a.policy, a.total) for a in report.asked)]
    top_h = max((t.gpu_hours for _, t in rows), default=0) or 1
    top_c = max((t.cold_starts for _, t in rows), default=0) or 1
    width = max(len(n) for n, _ in rows)
    console.print("GPU-hours █ · cold starts ▒")
    for name, t in rows:
        h = "█" * max(1, round(30 * t.gpu_hours / top_h)) if t.gpu_hours else ""
        c = "▒" * max(1, round(30 * t.cold_starts / top_c)) if t.cold_starts else ""
        console.print(f"  {name:<{width}}  {h:<30} {t.gpu_hours:>10,.1f}")
        console.print(f"  {'':<{width}}  {c:<30} {t.cold_starts:>10,}")
