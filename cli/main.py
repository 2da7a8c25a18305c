"""The ``llmgw`` entry point: one click group, commands loaded when used."""

from __future__ import annotations

import logging

import click

from llmgw import __version__
from llmgw.cli.options import LazyGroup

COMMANDS = {
    "nats": "llmgw.cli.nats_cmd:nats_cmd",
    "up": "llmgw.cli.up:up",
    "agent": "llmgw.cli.agent:agent",
    "router": "llmgw.cli.router:router",
    "project": "llmgw.cli.project:project",
    "planner": "llmgw.cli.planner:planner",
    "scheduler": "llmgw.cli.scheduler:scheduler",
    "replay": "llmgw.cli.replay:replay",
    "fake-engine": "llmgw.cli.fake_engine:fake_engine",
    "nats-conf": "llmgw.cli.natsconf:nats_conf",
    "declare-streams": "llmgw.cli.natsconf:declare_streams",
    "ctl": "llmgw.cli.ctl:ctl",
    "export": "llmgw.cli.export:export",
}


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings={"auto_envvar_prefix": "LLMGW", "help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmgw")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """llmgw: an event-sourced control plane for running LLMs on GPU fleets."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main() -> None:
    cli(prog_name="llmgw")


if __name__ == "__main__":
    main()
