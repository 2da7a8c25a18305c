"""What every command shares: NATS options, --json, and turning errors into ``Error: …``."""

from __future__ import annotations

import functools
import importlib
import json
import re
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import click

from llmgw.config import Settings
from llmgw.errors import LlmgwError

T = TypeVar("T")


_EXAMPLES = re.compile(r"^([ \t]*)(Examples?:[ \t]*\n[ \t]*\n)(?![ \t]*\x08)", re.M)


def keep_examples(cmd: click.Command) -> click.Command:
    """Print the block after ``Example:`` line by line, as written.

    click rewraps every paragraph of a help text into one run-on line unless it
    starts with ``\\b``; every command's docstring ends with an example block, so
    the mark is added here, once, for all of them (subcommands too).
    """
    if cmd.help:
        cmd.help = _EXAMPLES.sub("\\1\\2\\1\b\n", cmd.help)  # indented like the rest: click dedents it
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            keep_examples(sub)
    return cmd


class LazyGroup(click.Group):
    """A group whose commands are imported when used, so ``--help`` stays fast.

    ``lazy`` maps a command name to ``"module:attribute"``; ``summaries`` to the
    one line ``--help`` lists for it, so listing imports none of them.
    """

    def __init__(self, *args: Any, lazy: dict[str, str] | None = None, summaries: dict[str, str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = lazy or {}
        self.summaries = summaries or {}

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        if not self.summaries:
            super().format_commands(ctx, formatter)
            return
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names), default=0)
        rows = []
        for name in names:
            summary = self.summaries.get(name)
            if summary is None:
                cmd = self.get_command(ctx, name)
                if cmd is None or cmd.hidden:
                    continue
                rows.append((name, cmd.get_short_help_str(limit)))
            else:
                rows.append((name, click.Command(name, help=summary).get_short_help_str(limit)))  # click's cut
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy:
            module_name, attr = self.lazy[cmd_name].split(":")
            cmd = getattr(importlib.import_module(module_name), attr)
            assert isinstance(cmd, click.Command)
            return keep_examples(cmd)
        found = super().get_command(ctx, cmd_name)
        return keep_examples(found) if found is not None else None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except LlmgwError as e:
            raise click.ClickException(str(e)) from e


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine the way every command does: uvloop when present, errors as ``Error: …``."""
    import asyncio  # here: the commands that ask one question (``OneShot``) never start an event loop

    try:
        import uvloop

        runner: Callable[[Coroutine[Any, Any, T]], T] = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        return runner(coro)
    except KeyboardInterrupt:
        sys.exit(130)


def settings_from(kwargs: dict[str, Any]) -> Settings:
    """Pop the NATS options out of a command's kwargs and build Settings."""
    return Settings.from_env(
        nats_url=kwargs.pop("nats_url", None),
        creds_file=kwargs.pop("nats_creds", None),
        user=kwargs.pop("nats_user", None),
        password=kwargs.pop("nats_password", None),
        tls_ca=kwargs.pop("tls_ca", None),
        tls_cert=kwargs.pop("tls_cert", None),
        tls_key=kwargs.pop("tls_key", None),
    )


def nats_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--nats-url and credentials; the command receives ``settings: Settings``."""
    opts = [
        click.option("--nats-url", envvar="LLMGW_NATS_URL",
                     help="NATS server(s), comma-separated [env LLMGW_NATS_URL, else NATS_URL; default nats://127.0.0.1:4222]."),
        click.option("--nats-creds", envvar="LLMGW_NATS_CREDS", help="NATS credentials file [env LLMGW_NATS_CREDS, else NATS_CREDS]."),
        click.option("--nats-user", envvar="LLMGW_NATS_USER", help="NATS user [env LLMGW_NATS_USER]."),
        click.option("--nats-password", envvar="LLMGW_NATS_PASSWORD", help="NATS password [env LLMGW_NATS_PASSWORD]."),
        click.option("--tls-ca", envvar="LLMGW_NATS_TLS_CA", help="CA bundle for TLS to NATS."),
        click.option("--tls-cert", envvar="LLMGW_NATS_TLS_CERT", help="Client certificate for TLS to NATS."),
        click.option("--tls-key", envvar="LLMGW_NATS_TLS_KEY", help="Client key for TLS to NATS."),
    ]

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs["settings"] = settings_from(kwargs)
        return f(*args, **kwargs)

    for opt in reversed(opts):
        wrapper = opt(wrapper)
    return wrapper


def checked_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A node, model or router name follows the one names rule (docs/concepts.md: Names), or it is a usage error.

    Every event carrying the name would be refused by every reader otherwise.
    """
    from llmgw.messages import name_problem

    if value is not None and (why := name_problem(value, param.human_readable_name)) is not None:
        raise click.BadParameter(why, ctx=ctx, param=param)
    return value


def checked_model_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A model name: the names rule, or parts of it joined by '/' (``org/model``)."""
    from llmgw.messages import name_problem

    if value is not None and (why := name_problem(value, param.human_readable_name, model=True)) is not None:
        raise click.BadParameter(why, ctx=ctx, param=param)
    return value


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """A TOML file of ``what`` (declarations, keys) as a dict; LlmgwError saying why it cannot be read."""
    import tomllib

    from llmgw.errors import LlmgwError

    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise LlmgwError(f"cannot read {path}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise LlmgwError(f"{path} is not valid TOML: {e}") from None
    except RecursionError:  # the parser recurses per level of nested arrays and inline tables
        raise LlmgwError(f"{path}: its arrays or inline tables are nested too deeply to be {what}") from None


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts instead of tables.")


def echo_json(data: Any) -> None:
    """One JSON document on stdout."""
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))
