"""``llmgw ctl model deploy|scale|remove|list|show``: declare what should serve, and see what does.

Over 600 lines: ``Ask`` and the checks both deploy and apply pass (options, plan, engine arguments)
read beside deploy's options, which fill it; split, each half would name the other's fields.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import click
import msgspec

if TYPE_CHECKING:
    from rich.console import Console

    from llmgw.ctl import Declaration

from llmgw import messages as m
from llmgw.cli.options import checked_model_name, echo_json, json_option, nats_options, run
from llmgw.cli.plan import engine_version_option, max_num_seqs_option, parallel_option
from llmgw.cli.progress import human_duration
from llmgw.config import Settings
from llmgw.errors import PlanError


def cached_text(r: m.ReplicaRow) -> str:
    """``84% of 1.2M``: the share of its prompt tokens the engine had cached, or - when none reported."""
    if not r.prompt_tokens:
        return "-"
    n = r.prompt_tokens
    size = f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(n)
    return f"{r.cached_tokens / n:.0%} of {size}"


class AskError(ValueError):
    """Options that contradict each other (deploy: a usage error; apply: an error at the model's entry)."""


class Ask(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What an operator asks of a deployment: ``ctl model deploy``'s options, an ``apply`` file's entry."""

    name: str
    model: str
    candidate: Annotated[int, msgspec.Meta(ge=1, le=1000)] | None = None
    precision: str | None = None
    engine: Literal["vllm", "llama.cpp"] | None = None
    tp: Annotated[int, msgspec.Meta(ge=1, le=m.MAX_GPUS)] | None = None
    pp: Annotated[int, msgspec.Meta(ge=1, le=m.MAX_GPUS)] | None = None
    gpu_class: str | None = None
    context: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)] | None = None
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    replicas: Annotated[int, msgspec.Meta(ge=1, le=m.MAX_REPLICAS)] = 1
    min_replicas: Annotated[int, msgspec.Meta(ge=0, le=m.MAX_REPLICAS)] | None = None
    max_replicas: Annotated[int, msgspec.Meta(ge=1, le=m.MAX_REPLICAS)] | None = None
    target_in_flight: Annotated[float, msgspec.Meta(gt=0, le=100_000)] = 4.0
    idle_ttl_s: Annotated[float, msgspec.Meta(ge=0, le=10 * 365 * 86400)] | None = None
    parallel: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 0
    file: str | None = None
    engine_args: tuple[str, ...] = ()
    # Engine arguments the allow-list refuses that the agents' operator allows (agent --allow-engine-arg).
    allow_engine_args: Annotated[tuple[str, ...], msgspec.Meta(max_length=64)] = ()
    routing: Literal["prefix", "least-outstanding"] = "prefix"
    roll: Literal["surge", "in-place"] = "surge"
    engine_version: str = ""  # vLLM's version to plan for ("": the fleet's)
    max_num_seqs: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 0
    exclusive: bool = False  # whole GPUs, alone; otherwise a replica books its share and packs beside others
    # vLLM: the fraction of each card it takes, which is what it books (None: the plan's, the version's default).
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    # vLLM: LoRA adapters loaded at once (--max-loras), and the largest rank (0: vLLM's default, 16).
    max_adapters: Annotated[int, msgspec.Meta(ge=0, le=m.MAX_ADAPTERS)] = 0
    max_lora_rank: Annotated[int, msgspec.Meta(ge=0, le=512)] = 0

    @property
    def asked(self) -> tuple[str, ...]:
        """The plan's derived figures this ask gives itself: compared as inputs (``ctl.declare``)."""
        return ("gpu_memory_utilization",) if self.gpu_memory_utilization is not None else ()


def planned_spec(settings: Settings, ask: Ask, *, fleet: Path | None, models_dir: str | None) -> m.ModelSpec:
    """The declaration the planner makes of ``ask`` (AskError for options that contradict each other)."""
    from llmgw import ctl

    reply = run(ctl.plan(settings, ask.model, plan_request(ask), fleet=fleet, models_dir=models_dir))
    return spec_of(ask, reply)


def plan_request(ask: Ask) -> m.PlanRequest:
    """What to ask the planner for ``ask`` (AskError for options that contradict each other)."""
    if ask.candidate is not None and ask.gpu_class is not None:
        raise AskError("--candidate already names the GPU class; give one or the other")
    if ask.max_lora_rank and not ask.max_adapters:
        raise AskError("--max-lora-rank sizes vLLM's LoRA slots: give --max-adapters N with it")
    if (ask.min_replicas is None) != (ask.max_replicas is None):
        raise AskError("autoscaling needs both --min-replicas and --max-replicas (or neither, for a fixed --replicas)")
    if ask.min_replicas is not None and ask.max_replicas is not None and ask.min_replicas > ask.max_replicas:
        raise AskError(f"--min-replicas {ask.min_replicas} is more than --max-replicas {ask.max_replicas}")
    util = ask.gpu_memory_utilization
    if util is not None and not 0 < util <= 1:  # NaN too
        raise AskError(f"--gpu-memory-utilization {util:g} is not a fraction of the card: give one above 0 and at "
                       "most 1, e.g. 0.3 for a vLLM that leaves 70 % of each card to others")
    return m.PlanRequest(model=ask.model, precisions=(ask.precision,) if ask.precision else (),
                         tp=(ask.tp,) if ask.tp else (), context=ask.context, all=ask.candidate is None,
                         kv_cache_dtype=ask.kv_cache_dtype, parallel=ask.parallel,
                         engine_version=ask.engine_version, max_num_seqs=ask.max_num_seqs,
                         gpu_memory_utilization=util, max_adapters=ask.max_adapters,
                         max_lora_rank=ask.max_lora_rank)


def spec_of(ask: Ask, reply: m.PlanReply) -> m.ModelSpec:
    """The declaration ``ask`` makes of the planner's ``reply`` (PlanError when nothing it asks for fits)."""
    from llmgw import ctl

    replicas = ask.replicas
    if ask.min_replicas is not None and ask.max_replicas is not None:
        replicas = min(max(replicas, ask.min_replicas), ask.max_replicas)  # where it starts; the load moves it
    util = ask.gpu_memory_utilization
    pp = ask.pp
    if pp is None and ask.tp is not None and ask.candidate is None:
        pp = 1  # --tp 1 means one GPU, not one GPU on each of several nodes
    chosen = ctl.choose(reply, candidate=ask.candidate, gpu_class=ask.gpu_class, engine=ask.engine, pp=pp)
    if util is not None and chosen.engine != "vllm":
        raise PlanError(f"--gpu-memory-utilization is vLLM's (the fraction of each card it takes), but the chosen "
                        f"candidate runs {chosen.precision} on {chosen.engine}, which books what its plan needs on "
                        "each GPU; drop --gpu-memory-utilization, or choose a vLLM precision (--precision bf16, fp8, "
                        "awq, …)")
    file = ctl.gguf_file(chosen, ask.file) if ask.file is not None else chosen.file
    planned = chosen.spec(ask.name, replicas)  # its engine_args hold what the plan needs (--enforce-eager)
    engine_args_checked(chosen.engine, (*planned.engine_args, *ask.engine_args), ask.allow_engine_args)
    return msgspec.structs.replace(planned, idle_ttl_s=ask.idle_ttl_s,
                                   engine_args=(*planned.engine_args, *ask.engine_args),
                                   min_replicas=ask.min_replicas, max_replicas=ask.max_replicas,
                                   target_in_flight=ask.target_in_flight, file=file, routing=ask.routing,
                                   roll=ask.roll, exclusive=ask.exclusive)


def engine_args_checked(engine: str, args: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    """Refused here, before anything is published, what every agent refuses (llmgw/engine/policy.py)."""
    from llmgw.engine import EnginePolicy, args_problem

    try:
        policy = EnginePolicy.of(allowed)
    except ValueError as e:
        raise PlanError(str(e)) from None
    if (why := args_problem(engine, args, policy)) is not None:
        raise PlanError(f"{why}; if the agents allow it, say so here too with --allow-engine-arg=FLAG "
                        "(apply: allow_engine_args = [\"FLAG\"])")


def declaration_json(done: Declaration) -> dict[str, Any]:
    return {"declared": msgspec.to_builtins(done.spec), "seq": done.seq, "unchanged": done.seq is None,
            "changes": list(done.changes), "plan_moved": list(done.moved),
            "plan_kept": bool(done.moved) and (done.seq is None or done.kept_figures)}


def echo_declaration(done: Declaration) -> None:
    """``declared``, ``changed`` (and what), or ``unchanged``; the plan's figures that moved, if any."""
    spec = done.spec
    if done.seq is None:
        click.echo(f"unchanged {spec.name}: declared as asked already; nothing published")
        if done.moved:
            click.echo(f"  the plan's figures moved since ({'; '.join(done.moved)}); kept as declared "
                       "(--replan publishes them, which restarts its replicas)")
        return
    if done.changes:
        click.echo(f"changed {spec.name}: {'; '.join(done.changes)}")
    elif not done.new:
        click.echo(f"replanned {spec.name}: {'; '.join(done.moved)}")
    click.echo(f"declared {_describe(spec)}")
    click.echo(f"  each replica {booking_text(spec)}")
    if done.changes and done.moved and done.kept_figures:
        click.echo(f"  the plan's figures moved since ({'; '.join(done.moved)}); kept as declared "
                   "(--replan publishes them, which restarts its replicas)")
    elif done.changes and done.moved:
        click.echo(f"  the plan's figures for it: {'; '.join(done.moved)}")
    if done.new:
        click.echo("the scheduler places it on free GPUs; watch with `llmgw ctl status`")
    elif done.rolls and spec.roll == "in-place":
        click.echo("the scheduler rolls it: each old replica stops once a new one is healthy in its place; where "
                   "there is no room for one more, an old one stops first (--roll in-place): the model then serves "
                   "nothing until the new one is healthy; watch with `llmgw ctl status`")
    elif done.rolls:
        click.echo("the scheduler rolls it: each old replica stops once a new one is healthy in its place, and "
                   "while there is no room for one more the old ones keep serving (`llmgw ctl status` says so; "
                   "--roll in-place stops one first instead); watch with `llmgw ctl status`")
    else:
        click.echo("its replicas keep running (nothing they run with changed)")


def booking_text(spec: m.ModelSpec) -> str:
    """What each replica books on its GPUs (``llmgw.fleet.state.booking_mib``), and whether it shares them."""
    if spec.exclusive:
        return "takes whole GPUs, alone (exclusive)"
    if spec.engine == "vllm" and 0 < spec.gpu_memory_utilization < 1:
        return (f"books {spec.gpu_memory_utilization:g} of each GPU it uses (what vLLM takes), beside other replicas "
                "that fit")
    if spec.engine != "vllm" and spec.gib_per_gpu > 0:
        return (f"books {spec.gib_per_gpu:.2f} GiB on each GPU it uses (weights + KV at its context and slots + "
                "buffers), beside other replicas that fit")
    return "takes whole GPUs (it books all of each)"


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
@click.argument("name", callback=checked_model_name)
@click.argument("model")
@click.option("--from-plan", is_flag=True, required=True, help="Take the spec from the planner (required: nothing is deployed unplanned).")
@click.option("--candidate", type=click.IntRange(1), help="The N-th candidate `ctl model plan MODEL` lists (with the same flags).")
@click.option("--precision", help="bf16, fp16, fp8, awq, gptq, q8_0, q6_K, q5_K_M or q4_K_M, or a pre-quantized checkpoint's own (int8, int4, fp4, mxfp4, bnb-8bit, bnb-4bit).")
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
@parallel_option
@engine_version_option
@max_num_seqs_option
@click.option("--file", "gguf", metavar="NAME.gguf|PATH",
              help="llama.cpp: the GGUF to serve, a file here or a name in the model's directory or repository "
                   "[default: the planner's conventional name, e.g. Qwen2.5-14B-Instruct-Q4_K_M.gguf].")
@click.option("--routing", type=click.Choice(["prefix", "least-outstanding"]), default="prefix", show_default=True,
              help="How routers pick a replica: prefix sends prompts that begin alike where their prefix is "
                   "cached (within a load bound); least-outstanding by load alone. docs/router.md, \"Routing\".")
@click.option("--roll", type=click.Choice(["surge", "in-place"]), default="surge", show_default=True,
              help="How a spec change replaces running replicas: surge starts each new one beside an old one and "
                   "waits, the old serving, while there is no room; in-place then stops an old one first (the "
                   "model serves nothing until the new one is healthy).")
@click.option("--exclusive", is_flag=True,
              help="Whole GPUs, alone: nothing is placed beside its replicas. Otherwise each books what its plan "
                   "needs on each GPU and shares the card with others that fit (README, \"Sharing GPUs\").")
@click.option("--gpu-memory-utilization", "util", type=click.FloatRange(0, 1, min_open=True), metavar="F",
              help="vLLM: the fraction of each card it takes, which is what it books; below the default it leaves "
                   "room on the card for others, and its KV cache is planned inside it [default: the engine "
                   "version's, 0.92 from vLLM 0.29].")
@click.option("--engine-arg", "engine_args", multiple=True, help="Extra engine argument, repeatable (e.g. --engine-arg=--enable-prefix-caching).")
@click.option("--allow-engine-arg", "allowed_args", multiple=True, metavar="FLAG",
              help="An --engine-arg flag the allow-list refuses that the agents are started to allow "
                   "(agent --allow-engine-arg), repeatable; agents without it still refuse to start it.")
@click.option("--replan", is_flag=True,
              help="Publish the plan's figures afresh even when nothing you asked changed (they are kept "
                   "as first declared otherwise: re-running a deploy restarts nothing).")
@click.option("--max-adapters", type=click.IntRange(0, m.MAX_ADAPTERS), default=0, show_default=True,
              help="vLLM: LoRA adapters each replica holds at once (--max-loras; their buffers are planned); "
                   "`ctl adapter add` declares them. llama.cpp attaches every declared adapter instead.")
@click.option("--max-lora-rank", type=click.IntRange(0, 512), default=0,
              help="vLLM: the largest adapter rank it takes [default with --max-adapters: 16].")
@click.option("--fleet", type=click.Path(dir_okay=False, path_type=Path), help="Plan against this fleet file instead of asking the planner.")
@click.option("--models-dir", envvar="LLMGW_MODELS_DIR", help="Directory of Org__Name model folders [env LLMGW_MODELS_DIR].")
@json_option
@nats_options
def deploy(name: str, model: str, from_plan: bool, candidate: int | None, precision: str | None, engine: str | None,
           tp: int | None, pp: int | None, gpu_class: str | None, context: int | None, kv_dtype: str, replicas: int,
           min_replicas: int | None, max_replicas: int | None, target_in_flight: float, idle_ttl: float | None,
           parallel: int, engine_version: str, max_num_seqs: int, gguf: str | None, routing: str,
           roll: str, exclusive: bool, util: float | None, engine_args: tuple[str, ...], allowed_args: tuple[str, ...],
           replan: bool,
           max_adapters: int, max_lora_rank: int, fleet: Path | None, models_dir: str | None, as_json: bool,
           settings: Settings) -> None:
    """Declare NAME to serve MODEL as the planner splits it; refused, unpublished, when it does not fit.

    Example:

        llmgw ctl model plan Qwen/Qwen2.5-14B-Instruct
        llmgw ctl model deploy qwen14 Qwen/Qwen2.5-14B-Instruct --from-plan --candidate 1 --replicas 2
        llmgw ctl model deploy qwen14 Qwen/Qwen2.5-14B-Instruct --from-plan --precision fp8 --tp 1 --gpu-class L40S-48GB
        llmgw ctl model deploy coder Qwen/Qwen2.5-Coder-32B-Instruct --from-plan --candidate 1 --min-replicas 0 --max-replicas 4
        llmgw ctl model deploy tiny ./models/tiny --from-plan --precision q8_0 --context 2048 --parallel 4
        llmgw ctl model deploy qwen8 Qwen/Qwen3-8B --from-plan --candidate 1 --engine-version 0.17.1 --max-num-seqs 64
        llmgw ctl model deploy qwen8 Qwen/Qwen3-8B --from-plan --precision fp8 --gpu-memory-utilization 0.3
        llmgw ctl model deploy llama70 meta-llama/Llama-3.3-70B-Instruct --from-plan --precision fp8 --tp 2 --exclusive
    """
    ask = Ask(
        name=name, model=model, candidate=candidate, precision=precision, engine=engine, tp=tp, pp=pp,  # type: ignore[arg-type]
        gpu_class=gpu_class, context=context, kv_cache_dtype=kv_dtype, replicas=replicas,  # type: ignore[arg-type]
        min_replicas=min_replicas, max_replicas=max_replicas, target_in_flight=target_in_flight,
        idle_ttl_s=idle_ttl, parallel=parallel, file=gguf, engine_args=engine_args, routing=routing,  # type: ignore[arg-type]
        allow_engine_args=allowed_args,
        roll=roll, engine_version=engine_version, max_num_seqs=max_num_seqs,  # type: ignore[arg-type]
        exclusive=exclusive, gpu_memory_utilization=util, max_adapters=max_adapters, max_lora_rank=max_lora_rank)
    try:
        spec = planned_spec(settings, ask, fleet=fleet, models_dir=models_dir)
    except AskError as e:
        raise click.UsageError(str(e)) from None
    from llmgw import ctl

    done = run(ctl.declare(settings, spec, replan=replan, asked=ask.asked))
    if as_json:
        echo_json(declaration_json(done))
        return
    echo_declaration(done)


@click.command("scale")
@click.argument("name", callback=checked_model_name)
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
@click.argument("name", callback=checked_model_name)
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


def split_text(tp: int, pp: int) -> str:
    """tp × pp and the nodes it spans: ``4×2, 2 nodes``."""
    return f"{tp}×{pp}, {pp} node{'s' if pp != 1 else ''}"


def runs_text(s: m.ModelSummary | m.ModelSpec) -> str:
    """Precision and engine: ``fp8 vllm``, ``q4_K_M llama.cpp``, ``awq vllm (--quantization awq)``."""
    quant = f" (--quantization {s.quantization})" if s.quantization and s.quantization != s.precision else ""
    return f"{s.precision} {s.engine}{quant}"


def scaling_text(s: m.ModelSummary) -> str:
    text = (f"auto {s.min_replicas}–{s.max_replicas}, {s.target_in_flight:g}/replica"
            if s.min_replicas is not None and s.target_in_flight is not None else "fixed")
    return text + (f", idle ttl {human_duration(s.idle_ttl_s)}" if s.idle_ttl_s else "")


def why_text(s: m.ModelSummary) -> str:
    if s.state == "failing":
        return f"its engine fails to start: {s.failure or '(no output)'}"
    return s.unplaceable or ("a request wakes it" if s.state == "parked" else
                             "`ctl model scale` brings it back" if s.state == "stopped" else "")


def memory_text(r: m.ReplicaRow) -> str:
    """What the engine holds on each node (its agent's reading) against what the replica booked there: ``n4: 40.0 /
    42.5 GiB``, ``- /`` until reported, ``over`` past the booking by more than OVERBOOK_MARGIN (its neighbours' room)."""
    parts = []
    for node in dict.fromkeys([*r.booked_mib, *r.observed_memory_mib]):
        used, booked = r.observed_memory_mib.get(node, 0), r.booked_mib.get(node, 0)
        over = " over" if used and booked and used > booked * (1 + m.OVERBOOK_MARGIN) else ""
        parts.append(f"{node}: {f'{used / 1024:.1f}' if used else '-'} / "
                     f"{f'{booked / 1024:.1f}' if booked else '-'} GiB{over}")
    return "\n".join(parts) or "-"


def kv_text(planned: int, observed: int, against: bool = True) -> str:
    """Observed KV tokens against the plan, with the plan's error; ``-`` until an engine reports. Not
    ``against`` the plan: a figure its card did not size (a simulated node, an explicit cache size)."""
    if not observed:
        return f"- / {planned:,}" if planned else "-"
    if not planned:
        return f"{observed:,} / -"
    if not against:
        return f"{observed:,} / {planned:,} (not sized by its card)"
    # Signed as the reader reads "observed / planned": observed below the plan is negative (the
    # JSON's kv_error is the plan's error, the other way round, as ctl model plan states it).
    return f"{observed:,} / {planned:,} ({(observed - planned) / observed:+.1%})"


replay_option = click.option("--replay", "use_replay", is_flag=True,
                             help="Fold the streams here instead of asking the projector.")


def _notice(text: str) -> None:
    click.echo(text, err=True)


@click.command("list")
@replay_option
@json_option
@nats_options
def list_models(use_replay: bool, as_json: bool, settings: Settings) -> None:
    """Every declared model: state, replicas, split, idle, GPU-hours held today.

    States: serving, starting, failing (its engines fail to start: the line why),
    parked (a request wakes it), unplaceable or stopped.

    Example:

        llmgw ctl model list
        llmgw ctl model list --json | jq '.[] | select(.state == "parked") | .name'
    """
    from llmgw import ctl

    rows = None if use_replay else ctl.list_models_now(settings, notice=_notice)  # one question: no event loop
    if rows is None:
        rows = run(ctl.list_models(settings, replay=True, notice=_notice))
    if as_json:
        echo_json(msgspec.to_builtins(rows))
        return
    from rich import box
    from rich.table import Table

    if not rows:
        click.echo("no model is declared; deploy one with `llmgw ctl model deploy NAME MODEL --from-plan`")
        return
    table = Table(box=box.SIMPLE, title="replicas healthy/wanted · split tp×pp (pp nodes per replica) · GPU-hours held "
                                       "today (UTC) · KV cache tokens reserved / planned", title_justify="left")
    for col in ("model", "state", "replicas", "source", "runs", "split", "GPU class", "idle", "GPU-h", "KV obs / plan"):
        table.add_column(col, overflow="fold", no_wrap=col != "source", min_width=12 if col == "source" else None,
                         justify="right" if col in ("replicas", "idle", "GPU-h") else "left")
    for r in rows:
        table.add_row(r.name, r.state, f"{r.healthy}/{r.wanted}", r.source, runs_text(r), f"{r.tp}×{r.pp}",
                      r.gpu_class, human_duration(r.idle_s), f"{r.gpu_hours_today:.2f}",
                      kv_text(r.kv_tokens_planned, r.kv_tokens_observed))

    def draw(console: Console) -> None:
        console.print(table)
        for r in rows:  # what is not the default, and why a model is not serving
            notes = [x for x in (scaling_text(r), why_text(r)) if x and x != "fixed"]
            if notes:
                console.print(f"{r.name}: {'; '.join(notes)}")

    echo_rendered(draw)


def echo_rendered(draw: Callable[[Console], object]) -> None:
    """What ``draw`` prints, without rich's trailing spaces: as wide as the terminal, or 160 columns into a file."""
    from rich.console import Console

    terminal = Console().is_terminal
    buf = io.StringIO()
    # COLUMNS said: that width, piped or not (rich reads it).
    width = Console().width if terminal or os.environ.get("COLUMNS", "").isdigit() else 160
    draw(Console(file=buf, width=width, force_terminal=terminal, highlight=False, markup=False))
    click.echo("\n".join(line.rstrip() for line in buf.getvalue().splitlines()).strip("\n"))


def gpu_ranges(gpus: tuple[m.GpuRef, ...]) -> str:
    """GPU indexes per node, runs collapsed: ``n2:0-3 n3:0-3``."""
    by_node: dict[str, list[int]] = {}
    for g in gpus:
        by_node.setdefault(g.node, []).append(g.index)
    parts = []
    for node, idx in by_node.items():
        idx.sort()
        runs: list[str] = []
        start = prev = idx[0]
        for i in [*idx[1:], None]:
            if i is not None and i == prev + 1:
                prev = i
                continue
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            if i is not None:
                start = prev = i
        parts.append(f"{node}:{','.join(runs)}")
    return " ".join(parts)


DETAIL_IN_TABLE = 32  # a replica's detail up to this long is shown in its row; a longer one under the table


def _long(detail: str) -> bool:
    return len(detail) > DETAIL_IN_TABLE


def _time(t: datetime | None) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def render_detail(d: m.ModelDetail, console: Console) -> None:
    """``ctl model show``'s tables."""
    from rich import box
    from rich.table import Table

    from llmgw.messages import describe

    s, spec = d.summary, d.spec
    replicas = f"{s.wanted} replica{'s' if s.wanted != 1 else ''}"
    console.print(f"{s.name}: {s.state} · {s.healthy}/{s.wanted} healthy ({s.placed} placed; {replicas} wanted, "
                  f"set by {s.set_by}) · idle {human_duration(s.idle_s)} · {s.gpu_hours_today:.2f} GPU-hours today")
    why = why_text(s)
    gpus = f"{spec.tp * spec.pp} GPU{'s' if spec.tp * spec.pp != 1 else ''}"
    kv = Table(box=None, show_header=False, padding=(0, 2))
    kv.add_column(style=None)
    kv.add_column(overflow="fold")
    rows: list[tuple[str, str]] = [
        ("source", spec.source + (f" (file {spec.file})" if spec.file else "")),
        ("runs", f"{runs_text(spec)}{f' (--dtype {spec.dtype})' if spec.dtype != 'auto' else ''}, "
                 f"tp {spec.tp} × pp {spec.pp} = {gpus} per replica "
                 f"({spec.pp} node{'s' if spec.pp != 1 else ''}) of {spec.gpu_class}"),
        ("context", f"{spec.context:,} tokens"),
        ("scaling", scaling_text(s)),
        ("declared", f"{_time(s.declared_at)} UTC"),
    ]
    if spec.engine_args:
        rows.append(("engine args", " ".join(spec.engine_args)))
    if why:
        since = s.unplaceable_since if s.unplaceable else s.failure_at if s.state == "failing" else None
        rows.append(("why", why + (f" (since {_time(since)})" if since else "")))
    for k, v in rows:
        kv.add_row(k, v)
    console.print(kv)
    console.print("\nPlan (the candidate it was deployed from, as the spec records it)")
    plan = Table(box=None, show_header=False, padding=(0, 2))
    plan.add_column()
    plan.add_column(overflow="fold")
    plan.add_row("memory per GPU", f"{spec.gib_per_gpu:.2f} GiB (weights, overhead and KV cache) at "
                                   f"gpu_memory_utilization {spec.gpu_memory_utilization:g}" if spec.gib_per_gpu else "-")
    plan.add_row("booking", booking_text(spec))
    planned = spec.kv_tokens_planned
    if spec.engine == "llama.cpp":
        # Its -c is the pool its -np slots share: what it allocated says how much context each slot got.
        plan.add_row("KV cache", f"{planned:,} tokens per replica: {spec.slots} slot{'s' if spec.slots != 1 else ''} "
                                 f"x {spec.context:,} context (llama-server -np {spec.slots} -c {planned})")
        plan.add_row("observed", f"{s.kv_tokens_observed:,} tokens allocated / {planned:,} asked: "
                                 f"{s.kv_tokens_observed // spec.slots:,} context per slot / {spec.context:,} declared"
                     if s.kv_tokens_observed else "- (no engine has reported what it allocated)")
    else:
        plan.add_row("KV cache", f"{planned:,} tokens per replica (KV dtype {spec.kv_cache_dtype})"
                     if planned else f"- (KV dtype {spec.kv_cache_dtype})")
        plan.add_row("observed", kv_text(planned, s.kv_tokens_observed) + "  (KV tokens its engines reserved / planned)"
                     if s.kv_tokens_observed else "- (no engine whose card sized its cache has reported what it reserved)")
    console.print(plan)
    console.print(f"\nReplicas ({len(d.replicas)}; idle - = no router knows)")
    if d.replicas:
        reps = Table(box=box.SIMPLE)
        for col in ("replica", "state", "nodes", "GPUs", "fabric", "endpoint", "restarts", "idle", "KV tokens obs / plan",
                    "GPU used / booked", "prompt cached"):
            # Ids are read and copied whole: never folded (a UUID or URL folds only where the width is short).
            whole = col in ("replica", "nodes", "fabric")
            reps.add_column(col, overflow="fold", no_wrap=whole,
                            justify="right" if col in ("restarts", "idle", "prompt cached") else "left")
        for r in d.replicas:
            # An engine's failure detail is many joined lines: under the table, where it has the width.
            state = f"{r.state}: {r.detail}" if r.detail and not _long(r.detail) else r.state
            reps.add_row(r.replica_id, state, ",".join(r.nodes), "\n".join(f"{g.node}:{g.index} {g.uuid}" for g in r.gpus),
                         r.fabric or "-", r.endpoint or "-", str(r.restarts), human_duration(r.idle_s),
                         kv_text(r.kv_tokens_planned, r.kv_tokens_observed, against=r.kv_error is not None),
                         memory_text(r),
                         cached_text(r))
        console.print(reps)
        for r in d.replicas:
            if _long(r.detail):
                console.print(f"  {r.replica_id} {r.state}: {r.detail}")
        for r in d.replicas:
            if (o := r.overbooked) is not None:
                console.print(f"  {r.replica_id} held more than it booked: {o.used_mib / 1024:.1f} GiB on {o.node} against "
                              f"{o.booked_mib / 1024:.1f} booked ({o.source}, {_time(o.at)} UTC): the card's other "
                              "replicas have that much less room")
        console.print(f"  routed by {spec.routing} (docs/router.md, \"Routing\"); prompt cached: the share of prompt "
                      "tokens its engine served from its prefix cache, as the routers read it")
    else:
        console.print("  none placed\n")
    from llmgw.cli.coldstarts import render_cold_starts

    render_cold_starts(d, console)
    console.print(f"Events (the latest {len(d.events)}, oldest first; `llmgw replay --model {s.name}` for all)")
    if d.events:
        ev = Table(box=box.SIMPLE)
        for col in ("seq", "at (UTC)", "event"):
            ev.add_column(col, overflow="fold", justify="right" if col == "seq" else "left")
        for e in d.events:
            ev.add_row(str(e.seq), _time(e.event.at), describe(e.event))
        console.print(ev)


@click.command("show")
@click.argument("name")
@replay_option
@json_option
@nats_options
def show(name: str, use_replay: bool, as_json: bool, settings: Settings) -> None:
    """One model in full: spec and plan figures, each replica, the latest 20 events.

    Example:

        llmgw ctl model show qwen14
        llmgw ctl model show qwen14 --json | jq '.replicas[] | {replica_id, kv_error}'
    """
    from llmgw import ctl

    detail = None if use_replay else ctl.show_model_now(settings, name, notice=_notice)  # one question: no event loop
    if detail is None:
        detail = run(ctl.show_model(settings, name, replay=True, notice=_notice))
    if as_json:
        click.echo(msgspec.json.format(m.encode(detail), indent=2).decode())
        return
    echo_rendered(lambda console: render_detail(detail, console))
