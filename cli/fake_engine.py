"""``llmgw fake-engine``: an OpenAI-compatible stand-in for vLLM in tests and demos."""

from __future__ import annotations

import sys

import click

from llmgw.cli.options import run
from llmgw.engine import fake


@click.command("fake-engine")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True, help="Port; 0 picks a free one.")
@click.option("--model", "model", required=True, help="The served model name it answers for.")
@click.option("--name", default="", help="Replica name it reports in replies [default: the model name].")
@click.option("--latency-ms", type=click.FloatRange(0), default=0.0, show_default=True, help="Delay before each reply or first chunk.")
@click.option("--chunks", type=click.IntRange(0), default=5, show_default=True, help="Content chunks per streamed reply.")
@click.option("--chunk-interval-ms", type=click.FloatRange(0), default=0.0, show_default=True, help="Pause between streamed chunks.")
@click.option("--die-after-chunks", type=int, default=-1, show_default=True, help="Exit the process after sending N chunks of a stream (-1: never).")
@click.option("--die-on-request", is_flag=True, help="Exit the process on the first completion request, before any byte.")
@click.option("--refuse", is_flag=True, help="Answer every completion request with 503.")
@click.option("--startup-s", type=click.FloatRange(0, 3600), default=0.0, show_default=True,
              help="Seconds of start-up (loading weights): /health and completions answer 503 until then.")
@click.option("--kv-tokens", type=click.IntRange(0, 10**10), default=0, show_default=True,
              help="KV cache tokens it reports on /metrics as vLLM does (0: none).")
@click.option("--parts", type=click.IntRange(1, 64), default=1, show_default=True,
              help="A replica over this many nodes: serve only once the other parts have joined (--rendezvous-port).")
@click.option("--rendezvous-port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="With --parts: where the other nodes' parts connect.")
@click.option("--cache-slots", type=click.IntRange(0, 4096), default=0, show_default=True,
              help="A prefix cache of this many slots, LRU (cached_tokens in usage); 0: none.")
@click.option("--prefill-ms-per-token", type=click.FloatRange(0, 1000), default=0.0, show_default=True,
              help="Prefill time per prompt token not served from the cache (one prompt at a time).")
@click.option("--force-include-usage", is_flag=True,
              help="End every stream with a usage chunk, asked for or not (as vLLM's --enable-force-include-usage).")
@click.option("--done-linger-ms", type=click.FloatRange(0, 60_000), default=0.0, show_default=True,
              help="Pause between a stream's [DONE] and the end of its body (clients that stop reading at [DONE] close first).")
@click.option("--max-loras", type=click.IntRange(0, 1024), default=0, show_default=True,
              help="Load LoRA adapters at runtime as vLLM does (/v1/load_lora_adapter); N as its --max-loras (0: none).")
@click.option("--max-cpu-loras", type=click.IntRange(0, 4096), default=0, show_default=True,
              help="Loaded adapters whose weights it keeps, LRU, as vLLM's --max-cpu-loras (below --max-loras: that).")
@click.option("--lora-load-ms", type=click.FloatRange(0, 600_000), default=0.0, show_default=True,
              help="Time to load one adapter, and to read one again that its cache dropped.")
@click.option("--lora", "attached", multiple=True, metavar="NAME",
              help="An adapter attached at start as llama.cpp's --lora (repeat; ids 0, 1, … in order), "
                   "applied at the scales of a request's \"lora\" field.")
@click.option("--api-key", envvar="LLMGW_FAKE_API_KEY", default="", show_envvar=True,
              help="Refuse /v1/… requests without `Authorization: Bearer KEY` (401), as vLLM's --api-key does.")
@click.option("--join", "join_address", metavar="HOST:PORT",
              help="Be a worker part: join the head at HOST:PORT and hold until it goes away (no HTTP).")
def fake_engine(host: str, port: int, model: str, name: str, latency_ms: float, chunks: int,
                chunk_interval_ms: float, die_after_chunks: int, die_on_request: bool, refuse: bool,
                startup_s: float, kv_tokens: int, parts: int, rendezvous_port: int, cache_slots: int,
                prefill_ms_per_token: float, force_include_usage: bool, done_linger_ms: float,
                max_loras: int, max_cpu_loras: int, lora_load_ms: float, attached: tuple[str, ...],
                api_key: str, join_address: str | None) -> None:
    """Serve a fake OpenAI-compatible engine; prints its URL on the first stdout line.

    Routes: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models,
    /health, /stats. Replies name the replica (system_fingerprint, header
    x-llmgw-replica) so callers can tell which replica answered.

    LoRA adapters, as vLLM holds them (--max-loras: /v1/load_lora_adapter and
    /v1/unload_lora_adapter, a request's model naming one) or as llama-server
    does (--lora NAME, a request's "lora": [{"id": 0, "scale": 1.0}]): replies
    name the adapters that answered (content, header x-llmgw-adapter), and
    /stats counts requests per adapter, loads, reloads and evictions.

    Example:

    \b
        llmgw fake-engine --host 127.0.0.1 --port 0 --model qwen --latency-ms 20 --chunks 20
        llmgw fake-engine --port 0 --model qwen --chunks 10 --die-after-chunks 3
        llmgw fake-engine --port 0 --model qwen --max-loras 2 --lora-load-ms 150
        llmgw fake-engine --port 0 --model qwen --lora support --lora sql
    """
    if max_loras and attached:
        raise click.UsageError("--max-loras (vLLM's runtime loading) and --lora (llama.cpp's attached adapters) "
                               "are two engines' ways; give one")
    if join_address:
        try:
            run(fake.join(join_address, name or model))
        except OSError as e:
            raise click.ClickException(f"cannot join the head at {join_address} ({e}); is its part running?") from e
        raise SystemExit(5)  # the head went away
    try:
        sock = fake.bind(host, port)
    except OSError as e:
        raise click.ClickException(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or use --port 0") from e
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"http://{shown}:{bound}")
    sys.stdout.flush()
    opts = fake.EngineOptions(model=model, name=name or f"{model}@{bound}", latency_ms=latency_ms, chunks=chunks,
                         chunk_interval_ms=chunk_interval_ms, die_after_chunks=die_after_chunks,
                         die_on_request=die_on_request, refuse=refuse, startup_s=startup_s,
                         kv_tokens=kv_tokens, parts=parts, rendezvous_port=rendezvous_port,
                         cache_slots=cache_slots, prefill_ms_per_token=prefill_ms_per_token,
                         force_include_usage=force_include_usage, done_linger_ms=done_linger_ms,
                         max_loras=max_loras, max_cpu_loras=max_cpu_loras, lora_load_ms=lora_load_ms,
                         attached=attached, api_key=api_key)
    run(fake.serve(opts, sock, host))
