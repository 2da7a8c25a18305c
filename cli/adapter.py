"""``llmgw ctl adapter``: LoRA adapters declared on a base model (add, remove, list)."""

from __future__ import annotations

import click
import msgspec

from llmgw.cli.options import checked_model_name, echo_json, json_option, nats_options, run
from llmgw.config import Settings


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n < 1 << 30 else f"{n / (1 << 30):.2f} GiB"


@click.command("add")
@click.argument("name", callback=checked_model_name)
@click.argument("source")
@click.option("--base", required=True, callback=checked_model_name,
              help="The declared model it was trained for; a request for NAME is served by its replicas.")
@click.option("--models-dir", envvar="LLMGW_MODELS_DIR", help="Directory of Org__Name model folders [env LLMGW_MODELS_DIR].")
@json_option
@nats_options
def add(name: str, source: str, base: str, models_dir: str | None, as_json: bool, settings: Settings) -> None:
    """Declare adapter NAME, read from SOURCE, on the declared model BASE.

    SOURCE is a PEFT directory (adapter_config.json + adapter_model.safetensors: vLLM bases)
    or a GGUF adapter file (llama.cpp bases), here or a repository in the local Hugging Face
    cache. Rank, alpha, targets and size are read from it; an adapter of another model is
    refused with the reason. A vLLM base loads it where it is asked for; a llama.cpp base
    attaches every adapter at start, so adding one rolls its replicas.

    Example:

    \b
        llmgw demo-model models/tiny --lora sql
        llmgw ctl adapter add sql models/tiny/loras/sql.gguf --base tiny
    """
    from llmgw import ctl

    done = run(ctl.adapters.add(settings, name, base, source, models_dir))
    spec = done.adapter
    if as_json:
        echo_json({"adapter": msgspec.to_builtins(spec), "seq": done.seq, "base_seq": done.base_seq,
                   "unchanged": done.unchanged})
        return
    if done.unchanged:
        click.echo(f"unchanged {name}: declared as asked already; nothing published")
        return
    click.echo(f"declared adapter {name} on {base}: {spec.format}, rank {spec.rank}, alpha {spec.alpha:g}, "
               f"{', '.join(spec.target_modules)}, {_size(spec.size_bytes)}")
    if done.base_seq is not None:
        click.echo(f"{base} runs llama.cpp, which attaches adapters at start: re-declared with it attached; the "
                   "scheduler rolls its replicas (each new one healthy before an old one stops)")
    else:
        click.echo(f"a request for model {name!r} goes to a replica of {base} holding it; a router loads it where "
                   "none does")


@click.command("remove")
@click.argument("name", callback=checked_model_name)
@json_option
@nats_options
def remove(name: str, as_json: bool, settings: Settings) -> None:
    """Remove adapter NAME: no router sends requests for it any more.

    Example:

        llmgw ctl adapter remove sql
    """
    from llmgw import ctl

    done = run(ctl.adapters.remove(settings, name))
    if as_json:
        echo_json({"removed": name, "seq": done.seq, "base_seq": done.base_seq})
        return
    tail = f"; {done.adapter.base} re-declared without it (its replicas roll)" if done.base_seq is not None else ""
    click.echo(f"removed adapter {name}{tail}")


@click.command("list")
@json_option
@nats_options
def list_adapters(as_json: bool, settings: Settings) -> None:
    """Every declared adapter, its base, what it is, and the replicas holding it now.

    Example:

        llmgw ctl adapter list
    """
    from llmgw import ctl

    rows = run(ctl.adapters.listed(settings))
    if as_json:
        echo_json([{**msgspec.to_builtins(r.spec), "held_by": list(r.held_by)} for r in rows])
        return
    if not rows:
        click.echo("no adapters: `llmgw ctl adapter add NAME SOURCE --base MODEL` declares one")
        return
    click.echo(f"{'adapter':20} {'base':20} {'form':5} {'rank':>4} {'alpha':>6} {'size':>10}  held by")
    for r in rows:
        s = r.spec
        held = ", ".join(r.held_by) or ("-" if r.base_engine != "llama.cpp" else "(its replicas, at start)")
        click.echo(f"{s.name:20} {s.base:20} {s.format:5} {s.rank:>4} {s.alpha:>6g} {_size(s.size_bytes):>10}  {held}")
