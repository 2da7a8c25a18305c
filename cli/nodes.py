"""``llmgw ctl node retire``: remove a node that is gone for good."""

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
