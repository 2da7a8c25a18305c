"""``llmgw ctl idle``: replicas nobody asks for, the GPUs they hold, and stopping them."""

from __future__ import annotations

import sys
from typing import Any

import click

from llmgw import messages as m
from llmgw.cli.options import echo_json, json_option, nats_options, run
from llmgw.cli.progress import human_duration
from llmgw.config import Settings
from llmgw.fleet import IdleRow


def _older_than(ctx: click.Context, param: click.Parameter, value: str) -> float:
    from llmgw.cli.progress import parse_duration

    return parse_duration(value, "--older-than")


def _json_row(r: IdleRow) -> dict[str, Any]:
    return {"replica_id": r.replica_id, "model": r.model, "nodes": list(r.nodes), "gpus": r.gpus, "state": r.state,
            "idle_s": round(r.idle_s, 3) if r.idle_s is not None else -1,
            "idle_since": r.idle_since.isoformat() if r.idle_since else None,
            "gpu_hours_idle": round(r.gpu_hours_idle, 4)}


def summary_line(replicas: int, gpus: int, older_than_s: float, hours: float) -> str:
    """``2 replicas idle ≥ 5m hold 4 GPUs; 6.00 GPU-hours idle`` (``1 replica … holds 1 GPU``)."""
    holds = f"hold{'s' if replicas == 1 else ''} {gpus} GPU{'s' if gpus != 1 else ''}"
    return (f"{replicas} replica{'s' if replicas != 1 else ''} idle ≥ {human_duration(older_than_s)} {holds}; "
            f"{hours:.2f} GPU-hours idle")


@click.command("idle")
@click.option("--older-than", "older_than_s", default="30m", show_default=True, callback=_older_than,
              help="Idle at least this long (90s, 30m, 1h30m, 2d).")
@click.option("--model", "model", metavar="NAME", default=None,
              help="Only this model's replicas (with --stop: stop only those).")
@click.option("--stop", is_flag=True, help="Stop the replicas listed (ReplicaStopped, reason idle); their GPUs are freed.")
@click.option("--dry-run", is_flag=True, help="With --stop: say what would be stopped, publish nothing.")
@click.option("--replay", is_flag=True,
              help="Fold the streams here instead of asking the projector (what it does when none runs).")
@click.option("--no-snapshot", is_flag=True, help="When replaying: fold from sequence 1, not from the newest fold snapshot.")
@json_option
@nats_options
def idle(older_than_s: float, model: str | None, stop: bool, dry_run: bool, replay: bool, no_snapshot: bool,
         as_json: bool, settings: Settings) -> None:
    """Replicas idle longer than --older-than, the GPUs they hold, and GPU-hours idle.

    A replica no router has reported is unknown, never idle: it is counted
    apart and never stopped. A stopped replica stays stopped until
    `llmgw ctl model scale NAME --replicas N`.

    The answer comes from the projector (`llmgw project`) once it has folded
    every event stored when you asked; with no projector, or one that is
    behind, the streams are replayed here. Idle is measured against this
    machine's clock.

    Example:

        llmgw ctl idle --older-than 2h
        llmgw ctl idle --older-than 1h30m --model qwen
        llmgw ctl idle --older-than 2h --stop --dry-run
        llmgw ctl idle --older-than 2h --stop --json
    """
    from llmgw import ctl

    adapters: list[m.AdapterStatus] = []
    def notice(line: str) -> None:
        click.echo(line, err=True)

    # One question to the projector, no event loop; the replay (none answered, or --replay) folds with one.
    found = None if replay else ctl.idle_now(settings, older_than_s, notice=notice, model=model, adapters=adapters)
    rows, now, source = found or run(ctl.fetch_idle(settings, older_than_s, replay=True, notice=notice,
                                                    use_snapshots=not no_snapshot, model=model, adapters=adapters))
    chosen = [r for r in rows if r.idle_s is not None]
    unknown = [r for r in rows if r.idle_s is None]
    stopped: list[str] = []
    if stop and not dry_run and chosen:
        run(ctl.stop_idle(settings, chosen))
        stopped = [r.replica_id for r in chosen]
    if as_json:
        echo_json({
            "now": now.isoformat(), "older_than_s": older_than_s, "model": model,
            "idle": [_json_row(r) for r in chosen],
            "gpus_held": sum(r.gpus for r in chosen),
            "gpu_hours_idle": round(sum(r.gpu_hours_idle for r in chosen), 4),
            "unknown": [r.replica_id for r in unknown],
            "stopped": stopped, "dry_run": dry_run, "source": source,
            "adapters_idle": [{"name": a.name, "base": a.base, "last_request": a.last_request.isoformat()
                               if a.last_request else None, "held_by": list(a.held_by)} for a in adapters],
        })
        return
    _render(chosen, unknown, older_than_s, stop, dry_run, model)
    if adapters:
        names = ", ".join(f"{a.name} ({a.base})" for a in adapters)
        click.echo(f"LoRA adapters nobody asked for in {human_duration(older_than_s)}: {names}; "
                   "`llmgw ctl adapter remove NAME` frees their slots")


def _render(chosen: list[IdleRow], unknown: list[IdleRow], older_than_s: float, stop: bool, dry_run: bool,
            model: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160, highlight=False)
    if not chosen:
        of = f" of {model}" if model else ""
        console.print(f"no replica{of} idle for {human_duration(older_than_s)} or more")
    else:
        table = Table(box=None, pad_edge=False)
        for col, just in (("replica", "left"), ("model", "left"), ("nodes", "left"), ("GPUs", "right"),
                          ("state", "left"), ("idle", "right"), ("GPU-hours idle", "right")):
            table.add_column(col, justify=just)  # type: ignore[arg-type]
        for r in chosen:
            table.add_row(r.replica_id, r.model, ",".join(r.nodes), str(r.gpus), r.state, human_duration(r.idle_s), f"{r.gpu_hours_idle:.2f}")
        console.print(table)
        gpus = sum(r.gpus for r in chosen)
        hours = sum(r.gpu_hours_idle for r in chosen)
        console.print(summary_line(len(chosen), gpus, older_than_s, hours))
    if unknown:
        console.print(f"{len(unknown)} replica{'s' if len(unknown) != 1 else ''} with unknown idle time "
                      f"(no router has reported them) are not counted: {', '.join(r.replica_id for r in unknown)}")
    if chosen and stop:
        verb = "would stop" if dry_run else "stopped"
        console.print(f"{verb}: {', '.join(r.replica_id for r in chosen)}")
    elif chosen:
        console.print("stop them with --stop (try --dry-run first)")
