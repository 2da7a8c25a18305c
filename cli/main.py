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
    "apply": "llmgw.cli.apply:apply",
    "dashboard": "llmgw.cli.dashboard:dashboard",
    "export": "llmgw.cli.export:export",
    "demo-model": "llmgw.cli.demo_model:demo_model",
}

# `llmgw --help` lists these instead of importing every command for its docstring (the router,
# the agent, DuckDB… took it from ~0.1 s to ~0.8 s). tests/test_cli_help.py keeps them equal.
SUMMARIES = {
    "nats": "Run the embedded nats-server (JetStream on) and declare llmgw's streams.",
    "up": "Run a whole control plane here: NATS, projector, planner, scheduler, router (and simulated agents).",
    "agent": "Report this node's GPUs (NVML) and their health to the fleet stream.",
    "router": "Serve the OpenAI API in front of the healthy replicas; prints its URL on the first line.",
    "project": "Fold the fleet, control and usage streams into DuckDB and serve `ctl status`.",
    "planner": "Answer plan requests over NATS, from its own fold of the fleet and control streams.",
    "scheduler": "Place declared models on free healthy GPUs; re-place after faults (one leader at a time).",
    "replay": "Print the stored history as a timeline, oldest first.",
    "fake-engine": "Serve a fake OpenAI-compatible engine; prints its URL on the first stdout line.",
    "nats-conf": "Generate nats.conf with one user per role and one per agent node.",
    "declare-streams": "Declare llmgw's streams (create, or update to this version's limits); log in as admin.",
    "ctl": "Ask the control plane: plans, status, what can be stopped.",
    "apply": "Declare every model in FILE as `ctl model deploy` would; unchanged ones are left alone.",
    "dashboard": "Serve a live, read-only web page of the fleet; prints its URL on the first line.",
    "export": "Write the projection's tables as Parquet (pandas, Spark, Polars, any DuckDB).",
    "demo-model": "Write a tiny random-weight llama (Q8_0 GGUF and config.json) to plan and serve offline.",
}


@click.group(cls=LazyGroup, lazy=COMMANDS, summaries=SUMMARIES, context_settings={"auto_envvar_prefix": "LLMGW", "help_option_names": ["-h", "--help"]})
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
