"""``llmgw ctl key create|import|list|show|update|revoke``: API keys as events on the control stream (admin)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import click
import msgspec

from llmgw import messages as m
from llmgw.cli.options import checked_name, echo_json, json_option, nats_options, read_toml, run
from llmgw.config import Settings

LIMIT = click.IntRange(1, 10**15)


def _expires(ctx: click.Context, param: click.Parameter, value: str | None) -> datetime | None:
    from llmgw.cli.progress import parse_duration

    return None if value is None else m.utcnow() + timedelta(seconds=parse_duration(value, "--expires"))


def _models(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    names = tuple(x.strip() for x in value.split(",") if x.strip())
    try:
        msgspec.convert(names, tuple[m.Ref, ...])
    except msgspec.ValidationError as e:
        raise click.BadParameter(f"{value!r}: {e}", param_hint="--models") from None
    return names


def key_options(f: Any) -> Any:
    for option in reversed((
        click.option("--tenant", help="Who the key is for (a team): usage is summed per tenant."),
        click.option("--models", callback=_models, help="Comma-separated models it may use [default: every model]."),
        click.option("--tokens-per-day", type=LIMIT, help="Prompt and completion tokens a day (UTC)."),
        click.option("--requests-per-minute", type=LIMIT, help="Requests a minute."),
        click.option("--priority", type=click.Choice(["high", "normal", "low"]), help="[default: normal]"),
        click.option("--expires", callback=_expires, metavar="DURATION", help="Valid for this long (e.g. 30d)."),
        click.option("--scope", type=click.Choice(["client", "viewer", "admin"]),
                     help="What it opens besides the routers: viewer, the dashboard's fleet; admin, that and the "
                          "tenants' names and usage [default: client, no dashboard]."),
    )):
        f = option(f)
    return f


def _row(k: m.KeyDeclared) -> dict[str, Any]:
    out = msgspec.to_builtins(k)
    for secretish in ("salt", "digest"):
        out.pop(secretish, None)
    return dict(out)


@click.command("create")
@click.argument("name", callback=checked_name)
@key_options
@json_option
@nats_options
def create(name: str, tenant: str | None, models: tuple[str, ...] | None, tokens_per_day: int | None,
           requests_per_minute: int | None, priority: str | None, expires: datetime | None, scope: str | None,
           as_json: bool, settings: Settings) -> None:
    """Create an API key; its secret is printed once (the stream holds a salted digest).

    \b
    Example:
        llmgw ctl key create team-a-ci --tenant team-a --models coder,qwen14 --requests-per-minute 600 --expires 90d
    """
    from llmgw import ctl

    secret, key_id, salt, digest = ctl.new_key_secret()
    event = m.KeyDeclared(at=m.utcnow(), name=name, lookup_id=key_id, salt=salt, digest=digest, tenant=tenant or "",
                          models=models or (), tokens_per_day=tokens_per_day, requests_per_minute=requests_per_minute,
                          priority=priority or "normal", expires_at=expires, scope=scope or "client")  # type: ignore[arg-type]
    seq = run(ctl.publish_key(settings, event, must_exist=False))
    if as_json:
        echo_json({"created": _row(event), "secret": secret, "seq": seq})
    else:
        click.echo(f"created key {name} (tenant {tenant or '-'}); its secret, shown this once:")
        click.echo(secret)
        click.echo("clients send it as `Authorization: Bearer <secret>` (the openai client's api_key); every router "
                   "takes it within a second or two")
        if scope in ("viewer", "admin"):
            click.echo(f"it opens the dashboard too ({'the fleet' if scope == 'viewer' else 'the fleet and tenants'})")


@click.command("update")
@click.argument("name", callback=checked_name)
@key_options
@json_option
@nats_options
def update(name: str, tenant: str | None, models: tuple[str, ...] | None, tokens_per_day: int | None,
           requests_per_minute: int | None, priority: str | None, expires: datetime | None, scope: str | None,
           as_json: bool, settings: Settings) -> None:
    """Change a key's tenant, models, limits, priority, expiry or scope; its secret stays the same.

    \b
    Example:
        llmgw ctl key update team-a-ci --tokens-per-day 2000000
    """
    from llmgw import ctl

    known = run(ctl.keys(settings)).get(name)
    if known is None:
        raise click.ClickException(f"no key named {name!r}; `llmgw ctl key list` shows them")
    changes = {k: v for k, v in (("tenant", tenant), ("models", models), ("tokens_per_day", tokens_per_day),
                                 ("requests_per_minute", requests_per_minute), ("priority", priority),
                                 ("expires_at", expires), ("scope", scope)) if v is not None}
    if not changes:
        raise click.UsageError("nothing to change: give --tenant, --models, --tokens-per-day, --requests-per-minute, "
                               "--priority, --expires or --scope")
    event = msgspec.structs.replace(known, at=m.utcnow(), **changes)
    seq = run(ctl.publish_key(settings, event, must_exist=True))
    if as_json:
        echo_json({"updated": _row(event), "seq": seq})
    else:
        click.echo(f"updated key {name}: " + ", ".join(f"{k} {v}" for k, v in changes.items()))


@click.command("revoke")
@click.argument("name", callback=checked_name)
@json_option
@nats_options
def revoke(name: str, as_json: bool, settings: Settings) -> None:
    """Revoke a key: every router refuses it within a second or two; its usage stays in history.

    \b
    Example:
        llmgw ctl key revoke team-a-ci
    """
    from llmgw import ctl

    seq = run(ctl.publish_key(settings, m.KeyRevoked(at=m.utcnow(), name=name), must_exist=True))
    if as_json:
        echo_json({"revoked": name, "seq": seq})
    else:
        click.echo(f"revoked key {name}: every router refuses it from its next control event (a second or two)")


@click.command("list")
@json_option
@nats_options
def list_keys(as_json: bool, settings: Settings) -> None:
    """The live keys, their tenants and limits (never a secret or a digest)."""
    from llmgw import ctl

    live = run(ctl.keys(settings))
    if as_json:
        echo_json([_row(k) for k in live.values()])
        return
    if not live:
        click.echo("no keys: `llmgw ctl key create NAME` makes one")
        return
    click.echo(f"{'key':24} {'tenant':16} {'models':24} {'req/min':>9} {'tokens/day':>12} {'priority':8} expires")
    for k in live.values():
        click.echo(f"{k.name:24} {k.tenant or '-':16} {','.join(k.models) or 'every':24} "
                   f"{k.requests_per_minute or '-':>9} {k.tokens_per_day or '-':>12} {k.priority:8} "
                   f"{k.expires_at.isoformat(timespec='seconds') if k.expires_at else '-'}")


@click.command("show")
@click.argument("name", callback=checked_name)
@json_option
@nats_options
def show(name: str, as_json: bool, settings: Settings) -> None:
    """One key: its tenant, models, limits, priority, expiry and when it was declared."""
    from llmgw import ctl

    known = run(ctl.keys(settings)).get(name)
    if known is None:
        raise click.ClickException(f"no key named {name!r}; `llmgw ctl key list` shows them")
    row = _row(known)
    if as_json:
        echo_json(row)
    else:
        for k, v in row.items():
            click.echo(f"{k:20} {v}")


MAX_IMPORT = 100_000  # keys in one file: a fleet's tenants and their clients, not a flood


class KeyEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A ``[[key]]`` table: ``ctl key create``'s argument and options, with underscores."""

    name: str
    tenant: str = ""
    models: tuple[str, ...] = ()
    tokens_per_day: int | None = None
    requests_per_minute: int | None = None
    priority: str = "normal"
    expires: str | None = None
    scope: str = "client"


def read_keys(path: Any) -> list[tuple[m.KeyDeclared, str]]:
    """The ``[[key]]`` tables of FILE as new keys' declarations and their secrets, each checked as `create`
    checks its options; LlmgwError naming the entry and what is wrong."""
    from llmgw.cli.progress import parse_duration
    from llmgw.errors import LlmgwError

    doc = read_toml(path, "keys")
    entries = doc.get("key")
    if set(doc) - {"key"} or not isinstance(entries, list) or not entries:
        raise LlmgwError(f"{path}: expected [[key]] tables (name, tenant, models, tokens_per_day, "
                         "requests_per_minute, priority, expires, scope), and nothing else")
    if len(entries) > MAX_IMPORT:
        raise LlmgwError(f"{path} holds {len(entries)} keys; at most {MAX_IMPORT:,} in one file")
    from llmgw import ctl

    out: list[tuple[m.KeyDeclared, str]] = []
    seen: set[str] = set()
    for i, raw in enumerate(entries):
        at = f"{path}: key[{i}]"
        try:
            entry = msgspec.convert(raw, KeyEntry)
            if (why := m.name_problem(entry.name, "name")) is not None:
                raise LlmgwError(why)
            if entry.name in seen:
                raise LlmgwError(f"a second key named {entry.name!r}; each key once")
            seen.add(entry.name)
            expires = None if entry.expires is None else \
                m.utcnow() + timedelta(seconds=parse_duration(entry.expires, "expires"))
            secret, key_id, salt, digest = ctl.new_key_secret()
            event = msgspec.convert(dict(
                at=m.utcnow(), name=entry.name, lookup_id=key_id, salt=salt, digest=digest, tenant=entry.tenant,
                models=entry.models, tokens_per_day=entry.tokens_per_day,
                requests_per_minute=entry.requests_per_minute, priority=entry.priority, expires_at=expires,
                scope=entry.scope), m.KeyDeclared, from_attributes=True)
        except (msgspec.ValidationError, click.BadParameter, LlmgwError) as e:
            why = e.message if isinstance(e, click.BadParameter) else str(e)
            raise LlmgwError(f"{at}: {why}; the keys are `ctl key create`'s options with underscores") from None
        out.append((event, secret))
    return out


@click.command("import")
@click.argument("file", type=click.Path(dir_okay=False))
@json_option
@nats_options
def import_keys(file: str, as_json: bool, settings: Settings) -> None:
    """Create every key of FILE at once; their secrets are printed once, a `NAME<TAB>SECRET` line each.

    FILE holds [[key]] tables whose keys are `create`'s options with underscores (name, tenant,
    models = [..], tokens_per_day, requests_per_minute, priority, expires = "90d", scope). One
    name that exists already, or one bad entry, imports nothing. 10,000 keys are one batch on the
    bus, not 10,000 commands.

    \b
    Example:
        llmgw ctl key import keys.toml > secrets.tsv   # then hand each secret to its owner, and delete the file
    """
    from llmgw import ctl

    keys = read_keys(file)
    seqs = run(ctl.publish_keys(settings, [e for e, _ in keys]))
    if as_json:
        echo_json([{"created": _row(e), "secret": secret, "seq": seq}
                   for (e, secret), seq in zip(keys, seqs, strict=True)])
        return
    click.echo("\n".join(f"{e.name}\t{secret}" for e, secret in keys))
    click.echo(f"imported {len(keys)} key{'s' if len(keys) != 1 else ''}; every router takes them within a "
               "second or two", err=True)
