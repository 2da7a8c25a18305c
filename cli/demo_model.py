"""``llmgw demo-model``: a tiny random-weight llama to plan and serve without downloading one."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Literal

import click


def _size(n: int) -> str:
    return f"{n / 1024**2:.1f} MiB" if n >= 1024**2 else f"{n / 1024:.0f} KiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


@click.command("demo-model")
@click.argument("directory", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
@click.option("--format", "format_", type=click.Choice(["gguf", "hf"]), default=None,
              help="gguf: a Q8_0 GGUF for llama.cpp; hf: bf16 safetensors and tokenizer.json for vLLM. With --lora, "
                   "the adapter's: a GGUF adapter, or PEFT.  [default: gguf; with --lora, DIR's model's]")
@click.option("--context", type=int, default=2048, show_default=True, help="Context length the model states.")
@click.option("--layers", type=int, default=2, show_default=True, help="Transformer blocks.")
@click.option("--embd", type=int, default=None,
              help="Embedding width (a multiple of 32).  [default: 64; 128 with --format hf]")
@click.option("--heads", type=int, default=4, show_default=True,
              help="Attention heads (with --format hf each 32, 64 … 256 wide).")
@click.option("--kv-heads", type=int, default=2, show_default=True, help="KV heads (grouped-query attention).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--lora", "loras", multiple=True, metavar="NAME",
              help="Write a random LoRA adapter NAME for DIR's model into DIR/loras (repeatable); the model is "
                   "written first when DIR holds none.")
@click.option("--lora-rank", type=int, default=8, show_default=True, help="The adapters' rank (1 to 512).")
@click.option("--lora-alpha", type=float, default=16.0, show_default=True, help="The adapters' alpha (scale alpha / rank).")
@click.option("--lora-targets", default="all", show_default=True,
              help="The modules adapted: all, or some of q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj.")
def demo_model(directory: Path, format_: Literal["gguf", "hf"] | None, context: int, layers: int, embd: int | None,
               heads: int, kv_heads: int, seed: int, loras: tuple[str, ...], lora_rank: int, lora_alpha: float,
               lora_targets: str) -> None:
    """Write a tiny random-weight llama (Q8_0 GGUF and config.json) to plan and serve offline.

    It says nothing sensible, but llama-server loads it and answers chat
    completions with it, and the planner sizes it like any other model. The
    GGUF is named as the planner's llama.cpp commands name it: <folder>-Q8_0.gguf.
    With --format hf it is a Hugging Face checkpoint instead (model.safetensors,
    config.json, a byte-level BPE tokenizer.json with a ChatML chat template),
    which vLLM loads, on a CPU too (bash scripts/vllm.sh installs one).

    With --lora NAME it writes a random LoRA adapter for the model in DIR
    (written first if DIR holds none): DIR/loras/NAME.gguf for llama-server
    (--lora), or with --format hf a PEFT directory DIR/loras/NAME for vLLM.
    Unlike a new PEFT adapter (B = 0) it changes the model's answers.

    Example:

    \b
        llmgw demo-model models/llmgw-demo
        llmgw demo-model models/demo-big --layers 4 --embd 256 --context 4096
        llmgw demo-model models/llmgw-demo-hf --format hf
        llmgw ctl model plan models/llmgw-demo --fleet examples/fleet.toml
        llmgw demo-model models/llmgw-demo --lora sql --lora-rank 16
        llmgw demo-model models/llmgw-demo-hf --format hf --lora sql --lora chat
    """
    from llmgw.engine import check_demo_lora, demo_model_format, parse_lora_targets

    targets = parse_lora_targets(lora_targets)
    for name in loras:  # every mistake said before anything is written
        check_demo_lora(name, rank=lora_rank, alpha=lora_alpha, targets=targets)
    have = demo_model_format(directory) if loras else None
    if have is not None and format_ not in (None, have):
        raise click.ClickException(
            f"{directory} holds the {have} demo model; a {format_} adapter is for the other engine, which cannot "
            f"load that model: pass --format {have}, or write the adapter for a {format_} model in another DIR")
    try:
        if have is None:
            _write_model(directory, format_ or "gguf", context, layers, embd, heads, kv_heads, seed, hints=not loras)
        elif loras:
            click.echo(f"{directory} holds the {have} demo model already: the adapters are for it")
        if loras:
            _write_loras(directory, loras, format_ or have or "gguf", lora_rank, lora_alpha, targets, seed)
    except OSError as e:
        raise click.ClickException(f"cannot write into {directory} ({e.strerror or e}); pick a writable DIR") from e


def _write_model(directory: Path, format_: Literal["gguf", "hf"], context: int, layers: int, embd: int | None,
                 heads: int, kv_heads: int, seed: int, *, hints: bool) -> None:
    from llmgw.engine import write_demo_model

    made = write_demo_model(directory, format=format_, context=context, layers=layers, embd=embd, heads=heads,
                            kv_heads=kv_heads, seed=seed)
    kind = "Q8_0" if made.format == "gguf" else "bf16"
    click.echo(f"wrote {made.weights} ({_size(made.file_bytes)}, {kind}): llama, {_count(made.params)} parameters, "
               f"{made.layers} layers, embedding {made.embd}, {made.heads} heads / {made.kv_heads} KV heads, "
               f"FFN {made.ffn}, vocabulary {made.vocab_size}, context {made.context}")
    for path in (made.config, *made.files):
        click.echo(f"wrote {path}")
    if not hints:
        return
    d = shlex.quote(str(directory))
    body = '{"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}'
    click.echo("\nnext:")
    if made.format == "gguf":
        click.echo(f"  llmgw ctl model plan {d} --fleet examples/fleet.toml   # or against a running control plane")
        click.echo(f"  llama-server -m {shlex.quote(str(made.gguf))} -c {made.context} --port 8080"
                   "   # no llama-server? bash scripts/llama-server.sh")
    else:
        # What a CPU vLLM needs: float32 (its bf16 attention can die of SIGILL), no torch.compile, and a
        # KV cache of a stated size (else it reserves 92 % of the host's memory, or refuses to start).
        click.echo(f"  llmgw ctl model plan {d} --fleet examples/cpu.toml   # or against a running control plane")
        click.echo(f"  vllm serve {d} --dtype float32 --enforce-eager --max-model-len {made.context} "
                   "--kv-cache-memory-bytes 64M --port 8080   # no vllm? bash scripts/vllm.sh")
    click.echo("  curl -s localhost:8080/v1/chat/completions -H 'content-type: application/json' "
               f"-d {shlex.quote(body)}")


def _write_loras(directory: Path, names: tuple[str, ...], format_: Literal["gguf", "hf"], rank: int, alpha: float,
                 targets: tuple[str, ...], seed: int) -> None:
    from llmgw.engine import vllm_lora_rank, write_demo_lora

    made = [write_demo_lora(directory, name, format=format_, rank=rank, alpha=alpha, targets=targets, seed=seed)
            for name in names]
    for lora in made:
        kind = "GGUF adapter, F16" if lora.format == "gguf" else "PEFT, bf16"
        click.echo(f"wrote {lora.path} ({kind}, {_size(lora.tensor_bytes)} of tensors): LoRA rank {lora.rank}, "
                   f"alpha {lora.alpha:g}, {lora.layers} layers x {', '.join(lora.targets)}")
    base = directory.resolve().name.replace("__", "/", 1).split("/")[-1].lower()  # the name a plan declares
    click.echo("\nnext:")
    for lora in made:
        click.echo(f"  llmgw ctl adapter add {shlex.quote(lora.name)} {shlex.quote(str(lora.path))} "
                   f"--base {shlex.quote(base)}")
    if format_ == "gguf":
        gguf = next(iter(sorted(directory.glob("*.gguf"))), directory / "MODEL.gguf")
        flags = " ".join(f"--lora {shlex.quote(str(lora.path))}" for lora in made)
        click.echo(f"  llama-server -m {shlex.quote(str(gguf))} {flags} --port 8080")
        entries = ", ".join(f'{{"id": {i}, "scale": {1.0 if i == 0 else 0.0}}}' for i in range(len(made)))
        click.echo(f'  # a request gives every adapter its scale, in --lora order: "lora": [{entries}] '
                   "(with no lora field at all, llama-server applies them all)")
    else:
        click.echo(f"  VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve {shlex.quote(str(directory))} --dtype float32 "
                   f"--enforce-eager --enable-lora --max-lora-rank {vllm_lora_rank(rank)} "
                   "--kv-cache-memory-bytes 64M --port 8080")
        for lora in made:
            body = json.dumps({"lora_name": lora.name, "lora_path": str(lora.path.resolve())})
            click.echo(f"  curl -s localhost:8080/v1/load_lora_adapter -H 'content-type: application/json' "
                       f"-d {shlex.quote(body)}")
