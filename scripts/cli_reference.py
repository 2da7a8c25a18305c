"""Write docs/cli.md: every command's and subcommand's ``--help``, as a person reads it.

    python scripts/cli_reference.py            # (re)write docs/cli.md
    python scripts/cli_reference.py --check    # exit 1 when docs/cli.md is not what it would write

The help is rendered by click itself at a fixed width, in an environment without ``LLMGW_*``
or ``NATS_*`` variables, so the page is the same on every machine; tests/test_docs.py fails
when it differs from what this script writes.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import click
from click.testing import CliRunner

from llmgw.cli.main import cli

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "cli.md"
WIDTH = 80  # columns, as in tests/test_cli_help.py

HEADER = """\
# CLI reference

<!-- Written by scripts/cli_reference.py from each command's --help; do not edit it by hand:
     change the command's docstring or options, then run `python scripts/cli_reference.py`. -->

Every `llmgw` command and subcommand, as `llmgw … --help` prints it at {width} columns. The
pages beside this one explain what the commands are for; this one is generated, so it is
always what the installed CLI says.
"""


def commands(group: click.Group = cli, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every command path under ``group``, a group before its subcommands (lazy ones loaded as listed)."""
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if cmd is None or cmd.hidden:
            continue
        yield (*path, name)
        if isinstance(cmd, click.Group):
            yield from commands(cmd, (*path, name))


def help_text(path: tuple[str, ...]) -> str:
    """What ``llmgw PATH --help`` prints at WIDTH columns."""
    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith(("LLMGW_", "NATS_"))}
    res = CliRunner().invoke(cli, [*path, "--help"], prog_name="llmgw", terminal_width=WIDTH, env=clean)
    if res.exit_code != 0:
        raise SystemExit(f"`llmgw {' '.join(path)} --help` failed ({res.exit_code}): {res.output or res.exception!r}")
    return res.output.rstrip() + "\n"


def anchor(title: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def render() -> str:
    """The whole page."""
    paths = [(), *commands()]
    titles = [" ".join(("llmgw", *p)) for p in paths]
    out = [HEADER.format(width=WIDTH)]
    out += [f"{'  ' * (len(p) - 1) if p else ''}- [{t}](#{anchor(t)})" for p, t in zip(paths, titles, strict=True)]
    for p, t in zip(paths, titles, strict=True):
        out += ["", f"## {t}", "", "```text", help_text(p).rstrip("\n"), "```"]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if argv[1:] == ["--check"]:
        if OUT.exists() and OUT.read_text() == text:
            return 0
        print(f"{OUT.relative_to(ROOT)} is not what the CLI's --help says; run `python scripts/cli_reference.py`",
              file=sys.stderr)
        return 1
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)} ({len(re.findall('^## llmgw', text, re.M))} commands)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
