"""``llmgw demo-model``: a tiny random-weight llama to plan and serve without downloading one."""

from __future__ import annotations

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
@click.option("--format", "format_", type=click.Choice(["gguf", "hf"]), default="gguf", show_default=True,
              help="gguf: a Q8_0 GGUF for llama.cpp; hf: bf16 safetensors and tokenizer.json for vLLM.")
@click.option("--context", type=int, default=2048, show_default=True, help="Context length the model states.")
@click.option("--layers", type=int, default=2, show_default=True, help="Transformer blocks.")
@click.option("--embd", type=int, default=None,
              help="Embedding width (a multiple of 32).  [default: 64; 128 with --format hf]")
@click.option("--heads", type=int, default=4, show_default=True,
              help="Attention heads (with --format hf each 32, 64 … 256 wide).")
@click.option("--kv-heads", type=int, default=2, show_default=True, help="KV heads (grouped-query attention).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
def demo_model(directory: Path, format_: Literal["gguf", "hf"], context: int, layers: int, embd: int | None, heads: int,
               kv_heads: int, seed: int) -> None:
    """Write a tiny random-weight llama (Q8_0 GGUF and config.json) to plan and serve offline.

    It says nothing sensible, but llama-server loads it and answers chat
    completions with it, and the planner sizes it like any other model. The
    GGUF is named as the planner's llama.cpp commands name it: <folder>-Q8_0.gguf.
    With --format hf it is a Hugging Face checkpoint instead (model.safetensors,
    config.json, a byte-level BPE tokenizer.json with a ChatML chat template),
    which vLLM loads, on a CPU too (bash scripts/vllm.sh installs one).

    Example:

    \b
        llmgw demo-model models/llmgw-demo
        llmgw demo-model models/demo-big --layers 4 --embd 256 --context 4096
        llmgw demo-model models/llmgw-demo-hf --format hf
        llmgw ctl model plan models/llmgw-demo --fleet examples/fleet.toml
    """
    from llmgw.engine import write_demo_model

    try:
        made = write_demo_model(directory, format=format_, context=context, layers=layers, embd=embd, heads=heads,
                                kv_heads=kv_heads, seed=seed)
    except OSError as e:
        raise click.ClickException(f"cannot write into {directory} ({e.strerror or e}); pick a writable DIR") from e
    kind = "Q8_0" if made.format == "gguf" else "bf16"
    click.echo(f"wrote {made.weights} ({_size(made.file_bytes)}, {kind}): llama, {_count(made.params)} parameters, "
               f"{made.layers} layers, embedding {made.embd}, {made.heads} heads / {made.kv_heads} KV heads, "
               f"FFN {made.ffn}, vocabulary {made.vocab_size}, context {made.context}")
    for path in (made.config, *made.files):
        click.echo(f"wrote {path}")
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
