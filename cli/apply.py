"""``llmgw apply FILE``: a file of model declarations, applied as ``ctl model deploy`` would, idempotently.

Every entry is planned before anything is published, so a file with one bad entry
publishes nothing; an entry whose inputs match what is declared publishes nothing
either (the same file applied twice restarts nothing), and one that changed rolls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import msgspec

from llmgw.cli.models import (
    Ask,
    AskError,
    declaration_json,
    echo_declaration,
    plan_request,
    spec_of,
)
from llmgw.cli.options import echo_json, json_option, nats_options, read_toml, run
from llmgw.cli.progress import parse_duration
from llmgw.config import Settings
from llmgw.errors import LlmgwError
from llmgw.messages import name_problem

MAX_ENTRIES = 1000


def read_declarations(path: Path) -> tuple[list[Ask], list[AdapterEntry]]:
    """A declarations file's ``[[model]]`` and ``[[adapter]]`` entries, from one read of it; LlmgwError naming
    the entry and the key for a bad one."""
    doc = read_toml(path, "declarations")
    return read_asks(doc, path), read_adapters(doc, path)


def read_asks(doc: dict[str, Any], path: Path) -> list[Ask]:
    """The ``[[model]]`` entries of a declarations file (``doc``, as ``read_toml`` read it from ``path``)."""
    extra = set(doc) - {"model", "adapter"}
    if extra:
        raise LlmgwError(f"{path}: unknown top-level key(s) {', '.join(sorted(extra))}; declarations are [[model]] "
                         "and [[adapter]] tables (see examples/models.toml)")
    entries = doc.get("model", [])
    if not isinstance(entries, list) or (not entries and not doc.get("adapter")):
        raise LlmgwError(f"{path} declares no model; add a [[model]] table with name and model (examples/models.toml)")
    if len(entries) > MAX_ENTRIES:
        raise LlmgwError(f"{path} declares {len(entries)} models; at most {MAX_ENTRIES} in one file")
    asks: list[Ask] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        name = entry.get("name") if isinstance(entry, dict) else None
        named = isinstance(name, str) and name_problem(name, "name", model=True) is None
        at = f"{path}: model[{i}]" + (f" ({name})" if named else "")
        if not isinstance(entry, dict):
            raise LlmgwError(f"{at}: must be a table ([[model]])")
        fields: dict[str, Any] = dict(entry)
        if "idle_ttl" in fields:
            ttl = fields.pop("idle_ttl")
            try:
                fields["idle_ttl_s"] = parse_duration(str(ttl), "idle_ttl")
            except click.BadParameter as e:
                raise LlmgwError(f"{at}: idle_ttl: {e.message}") from None
        if "idle_ttl_s" in entry:
            raise LlmgwError(f"{at}: write idle_ttl as a duration (\"2h\"), not idle_ttl_s")
        try:
            ask = msgspec.convert(fields, Ask)
        except msgspec.ValidationError as e:
            raise LlmgwError(f"{at}: {e}; the keys are deploy's options with underscores "
                             "(examples/models.toml)") from None
        if (why := name_problem(ask.name, "name", model=True)) is not None:  # as deploy checks its NAME
            raise LlmgwError(f"{at}: {why}") from None
        if ask.name in seen:
            raise LlmgwError(f"{at}: a second entry named {ask.name!r}; each model once")
        seen.add(ask.name)
        asks.append(ask)
    return asks


class AdapterEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An ``[[adapter]]`` table: ``ctl adapter add NAME SOURCE --base BASE``."""

    name: str
    source: str
    base: str


def read_adapters(doc: dict[str, Any], path: Path) -> list[AdapterEntry]:
    """The ``[[adapter]]`` entries of a declarations file (after ``read_asks`` has checked its top level)."""
    entries = doc.get("adapter", [])
    if not isinstance(entries, list):
        raise LlmgwError(f"{path}: adapter must be [[adapter]] tables")
    if len(entries) > MAX_ENTRIES:
        raise LlmgwError(f"{path} declares {len(entries)} adapters; at most {MAX_ENTRIES} in one file")
    out: list[AdapterEntry] = []
    for i, entry in enumerate(entries):
        at = f"{path}: adapter[{i}]"
        try:
            a = msgspec.convert(entry, AdapterEntry)
        except msgspec.ValidationError as e:
            raise LlmgwError(f"{at}: {e}; an adapter has name, source and base (ctl adapter add's)") from None
        for key in ("name", "base"):
            if (why := name_problem(getattr(a, key), key, model=True)) is not None:
                raise LlmgwError(f"{at}: {why}") from None
        if a.name in {x.name for x in out}:
            raise LlmgwError(f"{at}: a second adapter named {a.name!r}; each adapter once")
        out.append(a)
    return out


@click.command("apply")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--replan", is_flag=True, help="Publish the plans' figures afresh even for entries that did not change.")
@click.option("--fleet", type=click.Path(dir_okay=False, path_type=Path), help="Plan against this fleet file instead of asking the planner.")
@click.option("--models-dir", envvar="LLMGW_MODELS_DIR", help="Directory of Org__Name model folders [env LLMGW_MODELS_DIR].")
@json_option
@nats_options
def apply(file: Path, replan: bool, fleet: Path | None, models_dir: str | None, as_json: bool,
          settings: Settings) -> None:
    """Declare every model in FILE as `ctl model deploy` would; unchanged ones are left alone.

    FILE holds [[model]] tables whose keys are deploy's options with underscores
    (name, model, candidate, precision, tp, context, replicas, min_replicas,
    max_replicas, idle_ttl = "2h", routing, engine_args, exclusive = true,
    gpu_memory_utilization = 0.3, max_adapters, ...), and [[adapter]] tables
    (name, source, base: `ctl adapter add`'s), added once the models are. Every
    model is planned first: one that does not fit publishes nothing at all. Models
    declared but not in FILE are left as they are (`ctl model remove` removes one).

    \b
    Example:
        llmgw apply examples/models.toml
        llmgw apply models.toml --json
    """
    from llmgw import ctl

    asks, lora = read_declarations(file)
    requests = []
    for ask in asks:
        try:
            requests.append((ask.model, plan_request(ask)))
        except AskError as e:
            raise LlmgwError(f"{file}: model {ask.name!r}: {e}; nothing was applied") from None
    # One connection plans them all (16 questions at once) and one fold decides them: apply of 1,000
    # models took 262 s as 1,000 commands' worth of connections and replays.
    replies = run(ctl.plan_many(settings, requests, fleet=fleet, models_dir=models_dir))
    specs = []
    for ask, reply in zip(asks, replies, strict=True):
        try:
            if isinstance(reply, LlmgwError):
                raise reply
            specs.append(spec_of(ask, reply))
        except (AskError, LlmgwError) as e:
            raise LlmgwError(f"{file}: model {ask.name!r}: {e}; nothing was applied") from None
    try:
        done = run(ctl.declare_many(settings, [(spec, ask.asked) for ask, spec in zip(asks, specs, strict=True)],
                                    replan=replan))
    except LlmgwError as e:
        raise LlmgwError(f"{file}: {e}; nothing was applied") from None
    added = [run(ctl.adapters.add(settings, a.name, a.base, a.source, models_dir)) for a in lora]
    if as_json:
        echo_json([declaration_json(d) for d in done] + [
            {"adapter": msgspec.to_builtins(a.adapter), "seq": a.seq, "base_seq": a.base_seq, "unchanged": a.unchanged}
            for a in added])
        return
    for d in done:
        echo_declaration(d)
    for a in added:
        state = "unchanged" if a.unchanged else "declared"
        rolled = f"; {a.adapter.base} re-declared with it attached (a roll)" if a.base_seq is not None else ""
        click.echo(f"{state} adapter {a.adapter.name} on {a.adapter.base} ({a.adapter.format}, rank {a.adapter.rank}){rolled}")
    changed = sum(d.seq is not None for d in done)
    click.echo(f"{len(done)} model{'s' if len(done) != 1 else ''} in {file}: {changed} declared or changed, "
               f"{len(done) - changed} unchanged")
