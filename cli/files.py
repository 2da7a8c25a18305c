"""``llmgw ctl model prefetch|pin|unpin|files``: a model's files on the nodes."""

from __future__ import annotations

import dataclasses

import click

from llmgw.cli.options import (
    checked_model_name,
    checked_name,
    echo_json,
    json_option,
    nats_options,
    run,
)
from llmgw.config import Settings


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _bar(done: int, total: int, width: int = 20) -> str:
    share = min(1.0, done / total) if total else 0.0
    filled = round(share * width)
    return f"[{'#' * filled}{'.' * (width - filled)}] {share * 100:3.0f}%"


def _checked_nodes(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(checked_name(ctx, param, v) or v for v in value)


@click.command("prefetch")
@click.argument("name", callback=checked_model_name)
@click.option("--nodes", "nodes", multiple=True, callback=_checked_nodes,
              help="A node to fetch on (repeat for more). Default: every node with GPUs of the model's class.")
@click.option("--all", "all_nodes", is_flag=True, help="Every node, whatever its GPUs.")
@click.option("--revision", default="", help="A branch, tag or commit of the repository [default: main].")
@json_option
@nats_options
def prefetch(name: str, nodes: tuple[str, ...], all_nodes: bool, revision: str, as_json: bool,
             settings: Settings) -> None:
    """Ask agents to download model NAME's files before any replica needs them.

    Each agent fetches for its own node only, with huggingface_hub: the one GGUF of a llama.cpp
    model into its models directory, or a vLLM model's safetensors, configs and tokenizer into
    its Hugging Face cache; every file is checked against the hub's digest. `ctl model files`
    shows the progress; placement then prefers the nodes that hold them.

    Example:

    \b
        llmgw ctl model prefetch qwen-7b --nodes gpu-1 --nodes gpu-2
        llmgw ctl model prefetch qwen-7b --all
    """
    from llmgw.ctl import files

    done = run(files.prefetch(settings, name, nodes, all_nodes=all_nodes, revision=revision))
    if as_json:
        echo_json(dataclasses.asdict(done))
        return
    fetching = [n for n in done.nodes if n not in done.holding]
    click.echo(f"asked {len(done.nodes)} node{'s' if len(done.nodes) != 1 else ''} to fetch {name}'s files "
               f"(control #{done.seq}): {', '.join(fetching) or 'none'} fetch"
               + (f"; {', '.join(done.holding)} hold them already" if done.holding else ""))


@click.command("pin")
@click.argument("name", callback=checked_model_name)
@json_option
@nats_options
def pin(name: str, as_json: bool, settings: Settings) -> None:
    """Keep model NAME's files on every node that holds them, whatever the disk budget.

    An agent making room evicts the least recently used files that no placed or pinned model
    needs; a download that only a pinned model's files stand in the way of is refused instead.

    Example:

        llmgw ctl model pin qwen-7b
    """
    from llmgw.ctl import files

    seq = run(files.pin(settings, name, True))
    if as_json:
        echo_json({"pinned": name, "seq": seq})
        return
    click.echo(f"pinned {name}: no agent evicts its files (control #{seq})")


@click.command("unpin")
@click.argument("name", callback=checked_model_name)
@json_option
@nats_options
def unpin(name: str, as_json: bool, settings: Settings) -> None:
    """Let agents evict model NAME's files again when they need the room.

    Example:

        llmgw ctl model unpin qwen-7b
    """
    from llmgw.ctl import files

    seq = run(files.pin(settings, name, False))
    if as_json:
        echo_json({"unpinned": name, "seq": seq})
        return
    click.echo(f"unpinned {name}: its files may be evicted when a node needs the room (control #{seq})")


@click.command("files")
@click.argument("name", required=False, callback=checked_model_name)
@json_option
@nats_options
def files_cmd(name: str | None, as_json: bool, settings: Settings) -> None:
    """Where each model's files are: the nodes holding them complete, downloads and their progress.

    Example:

        llmgw ctl model files
    """
    from llmgw.ctl import files

    rows = run(files.files(settings, name))
    if as_json:
        echo_json([dataclasses.asdict(r) for r in rows])
        return
    if not rows:
        click.echo("no model declared")
        return
    width = max(len(r.name) for r in rows)
    for r in rows:
        size = _gib(r.size) if r.size else "-"
        where = f"on {len(r.nodes)} node{'s' if len(r.nodes) != 1 else ''}" + (f": {', '.join(r.nodes)}" if r.nodes else "")
        click.echo(f"{r.name:<{width}}  {size:>9}  {where}{'  (pinned)' if r.pinned else ''}")
        for f in r.fetching:
            rate = f"{_gib(int(f.rate))}/s" if f.rate else "-"
            click.echo(f"{'':<{width}}  fetching on {f.node} {_bar(f.done, f.total)} {_gib(f.done)} of "
                       f"{_gib(f.total)}, {rate}")
        for node, reason in r.failed:
            click.echo(f"{'':<{width}}  FAILED on {node}: {reason}")
