"""Every command's --help as a person reads it, and shell completion as a shell asks for it."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from llmgw.cli.main import cli


def commands(group: click.Group = cli, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        assert cmd is not None, name
        yield (*path, name)
        if isinstance(cmd, click.Group):
            yield from commands(cmd, (*path, name))


def example_lines(cmd: click.Command) -> list[str]:
    text = inspect.cleandoc(cmd.help or "")
    if "Example:" not in text:
        return []
    block = text.split("Example:", 1)[1].strip("\n").split("\n\n")[0]
    return [ln.strip() for ln in block.splitlines() if ln.strip() and ln.strip() != "\b"]


ALL = sorted(commands())


def test_every_command_is_found() -> None:
    assert {("up",), ("ctl", "status"), ("ctl", "model", "deploy"), ("agent", "fault")} <= set(ALL)


@pytest.mark.parametrize("path", ALL, ids=" ".join)
def test_help_prints_each_example_on_its_own_line(path: tuple[str, ...]) -> None:
    res = CliRunner().invoke(cli, [*path, "--help"], terminal_width=80)
    assert res.exit_code == 0, res.output
    cmd: click.Command = cli
    for name in path:
        assert isinstance(cmd, click.Group)
        found = cmd.get_command(click.Context(cmd), name)
        assert found is not None
        cmd = found
    printed = {ln.strip() for ln in res.output.splitlines()}
    missing = [ln for ln in example_lines(cmd) if ln not in printed]
    assert not missing, f"`llmgw {' '.join(path)} --help` rewrapped its examples:\n{res.output}"


def complete(words: str) -> list[str]:
    """What bash gets from `_LLMGW_COMPLETE=bash_complete` for the command line typed so far."""
    parts = words.split(" ")
    env = {"_LLMGW_COMPLETE": "bash_complete", "COMP_WORDS": words, "COMP_CWORD": str(len(parts) - 1)}
    res = CliRunner().invoke(cli, [], prog_name="llmgw", env=env)
    assert res.exit_code == 0, res.output
    return [ln.split(",", 1)[1] for ln in res.output.splitlines() if "," in ln]


def test_shell_completion_offers_commands_and_options() -> None:
    assert "ctl" in complete("llmgw c")
    assert {"status", "idle", "model"} <= set(complete("llmgw ctl "))
    assert "deploy" in complete("llmgw ctl model d")
    assert "--json" in complete("llmgw ctl status --j")
    script = CliRunner().invoke(cli, [], prog_name="llmgw", env={"_LLMGW_COMPLETE": "bash_source"})
    assert "_llmgw_completion" in script.output  # what `eval "$(_LLMGW_COMPLETE=bash_source llmgw)"` installs


def test_up_says_where_its_data_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_DATA_DIR", str(tmp_path))
    res = CliRunner().invoke(cli, ["up", "--nats-url", "nats://127.0.0.1:1", "--no-example"])
    assert res.exit_code == 1  # no NATS there: after the lines that say where things are
    assert f"data: {tmp_path}  (llmgw.duckdb, logs/; --data-dir or LLMGW_DATA_DIR moves it)" in res.output.splitlines()
    assert "Error: cannot reach NATS at nats://127.0.0.1:1" in res.output


def test_top_level_help_lists_the_commands_own_summaries_without_importing_them() -> None:
    from llmgw.cli.main import COMMANDS, SUMMARIES

    assert set(SUMMARIES) == set(COMMANDS)
    ctx = click.Context(cli)
    for name, summary in SUMMARIES.items():
        cmd = cli.get_command(ctx, name)
        assert cmd is not None and summary == cmd.get_short_help_str(1000), name
    res = CliRunner().invoke(cli, ["--help"], terminal_width=80)
    assert res.exit_code == 0, repr(res.exception)
    listed = res.output
    assert "  declare-streams  Declare llmgw's streams (create, or update to this..." in listed
