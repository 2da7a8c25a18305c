"""``llmgw ctl model deploy|scale|remove``: declare what should serve; the scheduler places it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import msgspec

from llmgw import messages as m
from llmgw.cli.options import checked_name, echo_json, json_option, nats_options, run
from llmgw.config import Settings
from llmgw.errors import LlmgwError


def _describe(spec: m.ModelSpec) -> str:
    split = f"tp {spec.tp}" + (f" × pp {spec.pp}" if spec.pp > 1 else "")
    count = f"{spec.replicas} replica{'s' if spec.replicas != 1 else ''}"
    if spec.autoscaled:
        count += (f" (autoscaled {spec.min_replicas}–{spec.max_replicas}, "
                  f"{spec.target_in_flight:g} in flight per replica)")
    return (f"{spec.name}: {spec.source} {spec.precision} ({spec.engine}) on {spec.tp * spec.pp} × {spec.gpu_class} "
            f"({split}), context {spec.context:,}, {count}")


REPLICAS = click.IntRange(0, m.MAX_REPLICAS)
SPLIT = click.IntRange(1, m.MAX_GPUS)


def _duration(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    from llmgw.cli.progress import parse_duration

    return None if value is None else parse_duration(value, "--idle-ttl")


@click.command("deploy")
@click.argument("name", callback=checked_name)
@click.argument("model")
@click.option("--from-plan", is_flag=True, required=True, help="Take the spec from the planner (required: nothing is deployed unplanned).")
@click.option("--candidate", type=click.IntRange(1), help="The N-th candidate `ctl model plan MODEL` lists (with the same flags).")
@click.option("--precision", help="bf16, fp16, fp8, awq, gptq, q8_0, q6_K, q5_K_M or q4_K_M.")
@click.option("--engine", type=click.Choice(["vllm", "llama.cpp"]), help="Check the precision's engine is this one.")
@click.option("--tp", type=SPLIT, help="GPUs per node.")
@click.option("--pp", type=SPLIT, help="Nodes (pipeline stages) in one fabric [default with --tp: 1].")
@click.option("--gpu-class", help="e.g. H100-80GB.")
@click.option("--context", type=click.IntRange(1, 1 << 30), help="Context length (max_model_len).")
@click.option("--kv-cache-dtype", "kv_dtype", type=click.Choice(["auto", "fp8"]), default="auto", show_default=True,
              help="vLLM's KV cache dtype (fp8 halves it); planned and passed to the engine.")
@click.option("--replicas", type=click.IntRange(1, m.MAX_REPLICAS), default=1, show_default=True, help="How many replicas.")
@click.option("--min-replicas", type=REPLICAS, help="Autoscale: never fewer (0: scale to zero; a request wakes it).")
@click.option("--max-replicas", type=click.IntRange(1, m.MAX_REPLICAS), help="Autoscale: never more.")
@click.option("--target-in-flight", type=click.FloatRange(min=0, min_open=True, max=100_000), default=4.0, show_default=True,
              help="Autoscale: requests in flight (and waiting) per replica to aim at.")
@click.option("--idle-ttl", callback=_duration, help="Stop a replica nobody asked for this long (e.g. 2h); the scheduler enforces it.")
@click.option("--engine-arg", "engine_args", multiple=True, help="Extra engine argument, repeatable (e.g. --engine-arg=--enable-prefix-caching).")
@click.option("--fleet", type=click.Path(dir_okay=False, path_type=Path), help="Plan against this fleet file instead of asking the planner.")
@click.option("--models-dir", envvar="LLMGW_MODELS_DIR", help="Directory of Org__Name model folders [env LLMGW_MODELS_DIR].")
@json_option
@nats_options
def deploy(name: str, model: str, from_plan: bool, candidate: int | None, precision: str | None, engine: str | None,
           tp: int | None, pp: int | None, gpu_class: str | None, context: int | None, kv_dtype: str, replicas: int,
           min_replicas: int | None, max_replicas: int | None, target_in_flight: float, idle_ttl: float | None,
           engine_args: tuple[str, ...], fleet: Path | None, models_dir: str | None, as_json: bool, settings: Settings) -> None:
    """Declare NAME to serve MODEL as the planner splits it; refused, unpublished, when it does not fit.

    Example:

        llmgw ctl model plan Qwen/Qwen2.5-14B-Instruct
        llmgw ctl model deploy qwen14 Qwen/Qwen2.5-14B-Instruct --from-plan --candidate 1 --replicas 2
        llmgw ctl model deploy qwen14 Qwen/Qwen2.5-14B-Instruct --from-plan --precision fp8 --tp 1 --gpu-class L40S-48GB
        llmgw ctl model deploy coder Qwen/Qwen2.5-Coder-32B-Instruct --from-plan --candidate 1 --min-replicas 0 --max-replicas 4
    """
    if candidate is not None and gpu_class is not None:
        raise click.UsageError("--candidate already names the GPU class; give one or the other")
    if (min_replicas is None) != (max_replicas is None):
        raise click.UsageError("autoscaling needs both --min-replicas and --max-replicas (or neither, for a fixed --replicas)")
    if min_replicas is not None and max_replicas is not None:
        if min_replicas > max_replicas:
            raise click.UsageError(f"--min-replicas {min_replicas} is more than --max-replicas {max_replicas}")
        replicas = min(max(replicas, min_replicas), max_replicas)  # where it starts; the load moves it
    request = m.PlanRequest(model=model, precisions=(precision,) if precision else (), tp=(tp,) if tp else (),
                            context=context, all=candidate is None, kv_cache_dtype=kv_dtype)  # type: ignore[arg-type]
    from llmgw import ctl

    try:
        reply = run(ctl.plan(settings, model, request, fleet=fleet, models_dir=models_dir))
        if pp is None and tp is not None and candidate is None:
            pp = 1  # --tp 1 means one GPU, not one GPU on each of several nodes
        chosen = ctl.choose(reply, candidate=candidate, gpu_class=gpu_class, engine=engine, pp=pp)
    except LlmgwError as e:
        raise click.ClickException(str(e)) from e
    spec = msgspec.structs.replace(chosen.spec(name, replicas), idle_ttl_s=idle_ttl, engine_args=engine_args,
                                   min_replicas=min_replicas, max_replicas=max_replicas,
                                   target_in_flight=target_in_flight)
    seq = run(ctl.publish_control(settings, m.ModelDeclared(at=m.utcnow(), spec=spec)))
    if as_json:
        echo_json({"declared": msgspec.to_builtins(spec), "seq": seq})
    else:
        click.echo(f"declared {_describe(spec)}")
        click.echo("the scheduler places it on free GPUs; watch with `llmgw ctl status`")


@click.command("scale")
@click.argument("name", callback=checked_name)
@click.option("--replicas", type=REPLICAS, required=True, help="How many replicas NAME should have (0 stops them all, keeps the declaration).")
@json_option
@nats_options
def scale(name: str, replicas: int, as_json: bool, settings: Settings) -> None:
    """Change how many replicas a declared model has (also brings back idle-stopped ones).

    Example:

        llmgw ctl model scale qwen14 --replicas 3
    """
    from llmgw import ctl

    seq = run(ctl.publish_control(settings, m.ModelScaled(at=m.utcnow(), name=name, replicas=replicas), must_exist=name))
    out: dict[str, Any] = {"scaled": name, "replicas": replicas, "seq": seq}
    if as_json:
        echo_json(out)
    else:
        click.echo(f"scaled {name} to {replicas} replica{'s' if replicas != 1 else ''}; watch with `llmgw ctl status`")


@click.command("remove")
@click.argument("name", callback=checked_name)
@json_option
@nats_options
def remove(name: str, as_json: bool, settings: Settings) -> None:
    """Stop every replica of a model and forget its declaration.

    Example:

        llmgw ctl model remove qwen14
    """
    from llmgw import ctl

    seq = run(ctl.publish_control(settings, m.ModelRemoved(at=m.utcnow(), name=name), must_exist=name))
    if as_json:
        echo_json({"removed": name, "seq": seq})
    else:
        click.echo(f"removed {name}; its replicas stop and their GPUs are freed")


@click.command("list")
@json_option
@nats_options
def list_models(as_json: bool, settings: Settings) -> None:
    """Every declared model: serving, starting, parked (a request wakes it), unplaceable or stopped.

    Example:

        llmgw ctl model list
        llmgw ctl model list --json | jq '.[] | select(.state == "parked") | .name'
    """
    from llmgw import ctl

    rows = run(ctl.list_models(settings))
    if as_json:
        echo_json(rows)
        return
    if not rows:
        click.echo("no model is declared; deploy one with `llmgw ctl model deploy NAME MODEL --from-plan`")
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(box=box.SIMPLE)
    for col in ("model", "state", "replicas", "scaling", "runs", "why"):
        table.add_column(col, overflow="fold")
    for r in rows:
        scaling = (f"auto {r['min_replicas']}–{r['max_replicas']}, {r['target_in_flight']:g}/replica"
                   if r["min_replicas"] is not None else "fixed")
        if r["idle_ttl_s"]:
            scaling += f", idle ttl {r['idle_ttl_s']:g}s"
        why = r["unplaceable"] or ("a request wakes it" if r["state"] == "parked" else
                                   "`ctl model scale` brings it back" if r["state"] == "stopped" else "")
        kv = ""
        if r["kv_tokens_planned"] and r["kv_tokens_observed"]:
            err = (r["kv_tokens_planned"] - r["kv_tokens_observed"]) / r["kv_tokens_observed"]
            kv = f"; KV {r['kv_tokens_observed']:,} tokens (planned {r['kv_tokens_planned']:,}, {err:+.1%})"
        table.add_row(r["name"], r["state"], f"{r['healthy']}/{r['placed']} healthy, {r['wanted']} wanted",
                      scaling, f"{r['source']} {r['precision']} on {r['gpus_per_replica']} × {r['gpu_class']}{kv}", why)
    Console(width=160, highlight=False, markup=False).print(table)
