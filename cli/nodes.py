"""``llmgw ctl node``: cordon, drain and uncordon a node; retire one that is gone for good."""

from __future__ import annotations

import click

from llmgw.cli.options import checked_name, echo_json, json_option, nats_options, run
from llmgw.config import Settings


@click.command("retire")
@click.argument("name", callback=checked_name)
@click.option("--reason", default="", help="Why, for the history (e.g. 'decommissioned, RMA 4711').")
@click.option("--force", is_flag=True, help="Retire it even though its agent still reports (it comes back if it does).")
@json_option
@nats_options
def retire(name: str, reason: str, force: bool, as_json: bool, settings: Settings) -> None:
    """Remove a lost node from the fleet for good (admin); if it reports again, it is back.

    Example:

        llmgw ctl node retire cpu-01 --reason "laptop, not coming back"
    """
    from llmgw import ctl

    seq = run(ctl.retire_node(settings, name, reason, force=force))
    if as_json:
        echo_json({"retired": name, "seq": seq})
    else:
        back = ("; its agent still runs and reports an inventory only at start or when its GPUs change: restart it "
                "to bring the node back" if force else "; if its agent ever reports again, the node is back")
        click.echo(f"retired {name}: no longer in `llmgw ctl status`, and nothing is placed on it{back}")


def _cordon(settings: Settings, name: str, reason: str, drain: bool, as_json: bool) -> None:
    from llmgw import ctl

    seq, on = run(ctl.cordon_node(settings, name, reason, drain=drain))
    if as_json:
        echo_json({"node": name, "cordoned": True, "drain": drain, "seq": seq, "replicas": on})
        return
    if drain:
        moved = (f"its {len(on)} replica{'s' if len(on) != 1 else ''} ({', '.join(on)}) move off it one by one, each "
                 "new one healthy elsewhere before the old one stops" if on else "no replica runs on it")
        click.echo(f"draining {name}: nothing new is placed on it, and {moved}; watch with `llmgw ctl status --replicas`")
    else:
        click.echo(f"cordoned {name}: nothing new is placed on it; what runs there keeps running "
                   f"({len(on)} replica{'s' if len(on) != 1 else ''}); `llmgw ctl node drain {name}` moves them")


@click.command("cordon")
@click.argument("name", callback=checked_name)
@click.option("--reason", default="", help="Why, for the history and status (e.g. 'fan replacement').")
@json_option
@nats_options
def cordon(name: str, reason: str, as_json: bool, settings: Settings) -> None:
    """Place nothing new on node NAME; what runs there keeps running.

    Example:

        llmgw ctl node cordon h100-a-03 --reason "flaky NVLink, ticket 4711"
    """
    _cordon(settings, name, reason, False, as_json)


@click.command("drain")
@click.argument("name", callback=checked_name)
@click.option("--reason", default="", help="Why, for the history and status.")
@json_option
@nats_options
def drain(name: str, reason: str, as_json: bool, settings: Settings) -> None:
    """Cordon node NAME and move its replicas off it, one by one, as a roll (no request lost).

    Example:

        llmgw ctl node drain h100-a-03 --reason "BIOS update"
    """
    _cordon(settings, name, reason, True, as_json)


@click.command("uncordon")
@click.argument("name", callback=checked_name)
@json_option
@nats_options
def uncordon(name: str, as_json: bool, settings: Settings) -> None:
    """Let node NAME take new replicas again (after a cordon, a drain or a quarantine).

    Example:

        llmgw ctl node uncordon h100-a-03
    """
    from llmgw import ctl

    seq, _ = run(ctl.cordon_node(settings, name, "", uncordon=True))
    if as_json:
        echo_json({"node": name, "cordoned": False, "seq": seq})
    else:
        click.echo(f"uncordoned {name}: the scheduler places replicas on it again")
