"""``llmgw ctl model plan``: will a model fit, and how to split it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
import msgspec

from llmgw import messages as m
from llmgw.cli.options import echo_json, json_option, nats_options, run
from llmgw.config import Settings
from llmgw.errors import LlmgwError


def _params(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    from llmgw.planner import parse_params

    try:
        return parse_params(value)
    except LlmgwError as e:
        raise click.BadParameter(str(e)) from e


def _fmt_params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def shares(c: m.Candidate) -> bool:
    """Whether one replica of the candidate leaves room on its cards for others."""
    return 0 < c.booked_gib_per_gpu < c.gpu_memory_gib


def books_cell(c: m.Candidate) -> str:
    """``1.30 of 14.40``: what one replica books on each GPU, of the card; ``whole card`` when that is all of it."""
    if not c.fits or not c.booked_gib_per_gpu:
        return "-"  # nothing to book; or a reply from a planner that predates bookings
    return f"{c.booked_gib_per_gpu:.2f} of {c.gpu_memory_gib:.2f}" if shares(c) else "whole card"


def sharing_text(c: m.Candidate) -> str:
    """What the candidate books and whether it shares: ``needs 1.30 of 14.40 GiB on each GPU (…): shares a card``."""
    if not c.booked_gib_per_gpu:
        return "books what the planner that answered does not say (an older planner)"
    what = (f"gpu_memory_utilization {c.gpu_memory_utilization:g} x the card" if c.engine == "vllm" else
            "weights + KV at its context and slots + buffers")
    if shares(c):
        return (f"needs {c.booked_gib_per_gpu:.2f} of {c.gpu_memory_gib:.2f} GiB on each GPU ({what}): shares a card, "
                f"{c.gpu_memory_gib - c.booked_gib_per_gpu:.2f} GiB left beside it; deploy --exclusive takes whole "
                "GPUs, alone")
    return f"needs {c.gpu_memory_gib:.2f} GiB on each GPU ({what}): the whole card"


def render(reply: m.PlanReply, model: str) -> None:
    """The plan as tables for people."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200, highlight=False)
    console.print(f"{reply.model}: {_fmt_params(reply.params)} parameters ({reply.params_source}); "
                  f"{reply.fleet_gpus} healthy GPUs in the fleet")
    if reply.engine_version:
        source = {"fleet": "the version the fleet's agents report", "--engine-version": "--engine-version",
                  "newest profile": "no agent reports one: the newest profile"}.get(reply.engine_version_source,
                                                                                      reply.engine_version_source)
        console.print(f"engine: vLLM {reply.engine_version} (profile {reply.engine_profile}; {source})")
    for note in reply.notes:
        console.print(f"note: {note}")
    if not reply.candidates:
        if not reply.notes:
            console.print("no candidate fits; --all lists every split with the reason")
        return
    table = Table(show_edge=False, pad_edge=False)
    for col, just in (("#", "right"), ("fits", "left"), ("class", "left"), ("fabric", "left"), ("nodes", "right"),
                      ("tp", "right"), ("pp", "right"), ("precision", "left"), ("engine", "left"),
                      ("weights GiB/GPU", "right"), ("KV GiB/GPU", "right"), ("KV tokens", "right"),
                      ("max ctx", "right"), ("context", "right"), ("replicas now", "right"),
                      ("books GiB/GPU", "right")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for i, c in enumerate(reply.candidates, 1):
        table.add_row(str(i), "yes" if c.fits else "no", c.gpu_class, c.fabric or "-", str(c.nodes), str(c.tp),
                      str(c.pp), c.precision, c.engine, f"{c.weights_gib_per_gpu:.2f}", f"{c.kv_gib_per_gpu:.2f}",
                      f"{c.kv_tokens:,}" + (" obs" if c.observed_kv_tokens is not None else ""),
                      f"{c.max_context:,}", f"{c.context:,}", str(c.replicas_now), books_cell(c))
    console.print(table)
    for i, c in enumerate(reply.candidates, 1):
        if c.graph_note:
            console.print(f"candidate {i}: {c.graph_note}", soft_wrap=True)
        if c.observed_kv_tokens is not None:
            err = (c.estimated_kv_tokens - c.observed_kv_tokens) / c.observed_kv_tokens if c.observed_kv_tokens else 0.0
            console.print(f"candidate {i}: KV tokens observed on this fleet ({c.observed_kv_tokens:,} reserved by an "
                          f"engine of this very spec; the estimate was {c.estimated_kv_tokens:,}, {err:+.1%})")
    console.print("\ncommands:")
    # The same command on several GPU classes is printed once, with every candidate it serves.
    lines: dict[str, list[int]] = {}
    for i, c in enumerate(reply.candidates, 1):
        extra = f"   # download {c.file} ({c.file_gib} GiB)" if c.file else ""
        why = f"   # does not fit: {c.reason}" if not c.fits else ""
        shown = "\n       ".join(c.node_commands) if c.node_commands else c.command
        lines.setdefault(f"{shown}{extra}{why}", []).append(i)
    for line, numbers in lines.items():
        console.print(f"{', '.join(map(str, numbers)):>3}  {line}", soft_wrap=True)
    first = next((i for i, c in enumerate(reply.candidates, 1) if c.fits), None)
    if first is not None:
        from llmgw.planner import plan_name

        name = plan_name(reply.model)  # the name its command serves it under
        spec = reply.candidates[first - 1].spec(name)
        console.print(f"\ncandidate {first} {sharing_text(reply.candidates[first - 1])}", soft_wrap=True)
        console.print(f"declaration for candidate {first} "
                      f"(`llmgw ctl model deploy {name} {model} --from-plan --candidate {first}` with the same flags):")
        console.print(m.encode(spec).decode(), soft_wrap=True)


parallel_option = click.option(
    "--parallel", type=click.IntRange(0, m.MAX_PARALLEL), default=0,
    help="Sequences one replica serves at once. llama.cpp: -np slots, each holding the whole --context, so its "
         "KV cache is N x context; vLLM: --max-num-seqs [default: llama.cpp 1 slot, vLLM its own].")

engine_version_option = click.option(
    "--engine-version", default="", metavar="VERSION",
    help="The vLLM version to plan for, e.g. 0.17.1 [default: the one the fleet's agents report, else the "
         "newest profile].")
max_num_seqs_option = click.option(
    "--max-num-seqs", type=click.IntRange(0, m.MAX_PARALLEL), default=0,
    help="vLLM's --max-num-seqs, planned and passed to the engine [default: the engine version's default "
         "on each card, 256 or 1024].")



@click.command("plan")
@click.argument("model")
@click.option("--fleet", "fleet_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Plan against this fleet file (what-if), without NATS.")
@click.option("--precision", "precisions", multiple=True,
              help="bf16, fp16, fp8, awq, gptq, q8_0, q6_K, q5_K_M or q4_K_M, or what a pre-quantized checkpoint is (int8, int4, fp4, mxfp4, bnb-8bit, bnb-4bit); repeatable [default: all the repository allows].")
@click.option("--tp", "tps", type=int, multiple=True, help="GPUs per node to split over; repeatable [default: 1, 2, 4, 8].")
@click.option("--context", type=int, help="Context every candidate must hold [default: the model's full context, else the largest that fits].")
@click.option("--gpu-memory-utilization", "util", type=float, default=None,
              help="Fraction of each card's total memory the engine may use [default: the engine version's, "
                   "0.9, or 0.92 from vLLM 0.29].")
@engine_version_option
@max_num_seqs_option
@click.option("--params", callback=_params, help="Parameter count override, e.g. 70.6B (when the checkpoint does not say).")
@click.option("--kv-cache-dtype", "kv_dtype", type=click.Choice(["auto", "fp8"]), default="auto", show_default=True,
              help="vLLM's KV cache dtype: fp8 halves it (auto: the model's, or the checkpoint's kv_cache_scheme).")
@parallel_option
@click.option("--all", "show_all", is_flag=True, help="Every split, also those that do not fit (default: the best per GPU class and precision).")
@click.option("--models-dir", envvar="LLMGW_MODELS_DIR",
              help="Directory of Org__Name model folders holding config.json [env LLMGW_MODELS_DIR].")
@json_option
@nats_options
def plan(model: str, fleet_path: Path | None, precisions: tuple[str, ...], tps: tuple[int, ...], context: int | None,
         util: float | None, engine_version: str, max_num_seqs: int, params: int | None, kv_dtype: str, parallel: int,
         show_all: bool, models_dir: str | None, as_json: bool, settings: Settings) -> None:
    """Will MODEL fit on the fleet, and how to split it: every candidate, with its engine command.

    MODEL is a Hugging Face repo id (offline from the HF cache with HF_HUB_OFFLINE=1)
    or a local directory holding config.json.

    Example:

    \b
        llmgw ctl model plan Qwen/Qwen2.5-Coder-32B-Instruct --precision bf16 --precision q4_K_M
        llmgw ctl model plan ./models/Llama-3.3-70B --fleet examples/fleet.toml --context 8192 --json
        llmgw ctl model plan Qwen/Qwen3-8B --fleet examples/fleet.toml --engine-version 0.17.1 --max-num-seqs 64
    """
    request = m.PlanRequest(model=model, precisions=precisions, tp=tps, context=context,
                            gpu_memory_utilization=util, params=params, all=show_all,
                            kv_cache_dtype=kv_dtype,  # type: ignore[arg-type]
                            parallel=parallel, engine_version=engine_version, max_num_seqs=max_num_seqs)
    from llmgw import ctl

    reply = run(ctl.plan(settings, model, request, fleet=fleet_path, models_dir=models_dir))
    if as_json:
        data: dict[str, Any] = msgspec.to_builtins(reply)
        echo_json(data)
    else:
        render(reply, model)
        if fleet_path is None:
            from llmgw.ctl import files

            for line in run(files.plan_files(settings, reply)):
                click.echo(line)
