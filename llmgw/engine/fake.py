"""A small OpenAI-compatible engine for tests and benchmarks: no GPU, no model.

It answers /v1/chat/completions (plain and streamed), /v1/completions,
/v1/embeddings, /v1/models and /health, names itself in every reply
(``system_fingerprint``, an ``x-llmgw-replica`` header, ``replica`` in
embeddings) so a test can tell which replica answered, and can misbehave on
purpose: slow replies, paced chunks, refusing, or dying before the first byte
or in the middle of a stream.

LoRA adapters, either way a real engine has them (llmgw/engine/fakeadapters.py): vLLM's,
loaded at runtime (``/v1/load_lora_adapter``, a set delay each), a request's ``model``
naming one; or llama.cpp's, attached at start (``--lora``) and applied at the request's
``lora`` scales. Replies say which adapters answered (their content, the ``x-llmgw-adapter``
header) and /stats counts requests per adapter.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import selectors
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from llmgw.engine.fakeadapters import Adapters, Lora

_ENCODER = msgspec.json.Encoder()


class _StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Message(msgspec.Struct):
    role: str = ""
    content: str | list[object] | None = None


class _Body(msgspec.Struct):
    """The parts of a request the fake engine looks at."""

    model: str = ""
    stream: bool = False
    input: str | list[object] = ""
    stream_options: _StreamOptions | None = None
    messages: list[_Message] = []
    prompt: str | list[object] = ""
    lora: list[Lora] | None = None
    max_tokens: int | None = None  # as an engine does: never more completion tokens than this

    def completion(self, tokens: int) -> int:
        """``tokens``, or fewer when the request's ``max_tokens`` says so."""
        return tokens if self.max_tokens is None else max(0, min(tokens, self.max_tokens))

    def text(self) -> bytes:
        """The prompt as the engine sees it: each message's role and text, in order (or the prompt)."""
        if self.messages:
            out = bytearray()
            for msg in self.messages:
                content = msg.content if isinstance(msg.content, str) else _ENCODER.encode(msg.content).decode()
                out += f"<|{msg.role}|>\n{content}\n".encode()
            return bytes(out)
        return self.prompt.encode() if isinstance(self.prompt, str) else _ENCODER.encode(self.prompt)


BYTES_PER_TOKEN = 4  # the fake engine's tokenizer: four bytes a token
BLOCK_TOKENS = 16  # its cache's block, as vLLM's


class PrefixCache:
    """Slots holding one prompt's blocks each, LRU, as llama-server's slots (or a small paged cache) do.

    A prompt takes the slot whose blocks share the longest beginning with it (its cached
    tokens) or, sharing none, the least recently used one; it then holds this prompt's blocks.
    """

    def __init__(self, slots: int) -> None:
        self.slots: list[list[int]] = [[] for _ in range(slots)]
        self.used: list[float] = [0.0] * slots

    @staticmethod
    def blocks(text: bytes, key: tuple[str, ...] = ()) -> list[int]:
        """The hashes of the whole blocks of ``text``, each of all before it and of ``key`` (its adapters:
        the same text under another adapter shares no block, as in vLLM's cache, whose hashes hold its LoRA)."""
        size = BYTES_PER_TOKEN * BLOCK_TOKENS
        out, h = [], hash(key) if key else 0
        for i in range(0, len(text) - size + 1, size):  # only whole blocks are cached
            h = hash((h, text[i:i + size]))
            out.append(h)
        return out

    def take(self, text: bytes, key: tuple[str, ...] = ()) -> int:
        """Cached tokens for this prompt (under adapters ``key``); its slot now holds it."""
        if not self.slots:
            return 0
        blocks = self.blocks(text, key)
        best, shared = 0, -1
        for i, held in enumerate(self.slots):
            n = 0
            for a, b in zip(held, blocks, strict=False):
                if a != b:
                    break
                n += 1
            if n > shared or (n == shared and self.used[i] < self.used[best]):
                best, shared = i, n
        if shared == 0:
            best = min(range(len(self.slots)), key=self.used.__getitem__)
        self.slots[best], self.used[best] = blocks, time.monotonic()
        return shared * BLOCK_TOKENS


_DECODER = msgspec.json.Decoder(_Body)
@dataclass
class EngineOptions:
    """How the fake engine behaves; every default is a healthy, instant engine."""

    model: str
    name: str = ""
    latency_ms: float = 0.0  # before the reply (or the first chunk)
    chunks: int = 5  # content chunks in a stream, before the final one and [DONE]
    chunk_interval_ms: float = 0.0  # pacing between chunks
    die_after_chunks: int = -1  # exit the process after sending this many chunks (-1: never)
    die_on_request: bool = False  # exit the process on the first completion request, before any byte
    refuse: bool = False  # answer every completion request with 503
    embedding_dim: int = 8
    startup_s: float = 0.0  # /health and completions answer 503 until then, like an engine loading weights
    kv_tokens: int = 0  # KV cache it claims on /metrics (vLLM's cache_config_info); 0: no such line
    parts: int = 1  # a head waiting for parts - 1 other nodes' parts to connect before it serves
    rendezvous_port: int = 0  # where they connect (the head's address is host:this)
    cache_slots: int = 0  # a prefix cache of this many slots (PrefixCache); 0: none, nothing is cached
    prefill_ms_per_token: float = 0.0  # time per prompt token not served from the cache, before the reply
    force_include_usage: bool = False  # a usage chunk on every stream, asked or not (vLLM's --enable-force-include-usage)
    done_linger_ms: float = 0.0  # between a stream's [DONE] and the end of its body (a real engine's generator ends later)
    max_loras: int = 0  # vLLM's LoRA slots: adapters loaded at runtime (0: none, llama.cpp's or no LoRA)
    max_cpu_loras: int = 0  # vLLM's cache of loaded adapter weights (below max_loras: max_loras)
    lora_load_ms: float = 0.0  # time to load one adapter, at load and when read again
    attached: tuple[str, ...] = field(default_factory=tuple)  # llama.cpp's --lora adapters, ids in this order
    api_key: str = ""  # refuse /v1/… without ``Authorization: Bearer <key>``, as vLLM's --api-key does ("": open)


@dataclass(frozen=True)
class _Answer:
    """Who answers a completion: the replica, with which adapters, under which model name."""

    engine: FakeEngine
    adapters: tuple[str, ...]
    model: str

    @property
    def text(self) -> str:
        said = f" (adapter{'s' if len(self.adapters) > 1 else ''} {', '.join(self.adapters)})" if self.adapters else ""
        return f"hello from {self.engine.name}{said}"

    @property
    def headers(self) -> dict[str, str]:
        return {**self.engine._headers, **({"x-llmgw-adapter": ",".join(self.adapters)} if self.adapters else {})}


class FakeEngine:
    """The aiohttp application and the counters tests read back through /stats."""

    def __init__(self, opts: EngineOptions) -> None:
        self.opts = opts
        self.name = opts.name or opts.model
        self.requests = 0
        self._headers = {"x-llmgw-replica": self.name}
        self._ready_at = time.monotonic() + opts.startup_s
        self.joined = 0  # other nodes' parts connected to this head
        self.cache = PrefixCache(opts.cache_slots)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._prefill = asyncio.Lock()  # one prompt is prefilled at a time, as on one GPU
        self.adapters = Adapters(opts.model, max_loras=opts.max_loras, max_cpu_loras=opts.max_cpu_loras,
                                 load_ms=opts.lora_load_ms, attached=opts.attached)
        self.running = 0  # requests in flight now (vLLM's num_requests_running)
        self.request_ids: deque[str] = deque(maxlen=64)  # the last requests' X-Request-Id, as the router sent them
        self.traceparents: deque[str] = deque(maxlen=64)  # … and their W3C traceparent ("" without one)
        self._busy_s = 0.0  # time with at least one request in flight, until _busy_since
        self._busy_since = 0.0

    def busy_seconds(self) -> float:
        """Time with at least one request in flight since start: the simulated GPU's utilization is its rate."""
        return self._busy_s + (time.monotonic() - self._busy_since if self.running else 0.0)

    @web.middleware
    async def _count(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if not request.path.startswith("/v1/") or request.method != "POST":
            return await handler(request)
        if not self.running:
            self._busy_since = time.monotonic()
        self.running += 1
        self.request_ids.append(request.headers.get("X-Request-Id", ""))
        self.traceparents.append(request.headers.get("traceparent", ""))
        try:
            return await handler(request)
        finally:
            self.running -= 1
            if not self.running:
                self._busy_s += time.monotonic() - self._busy_since

    def _loading(self) -> web.Response | None:
        left = self._ready_at - time.monotonic()
        if left <= 0 and self.joined >= self.opts.parts - 1:
            return None
        why = f"loading ({left:.1f}s left)" if left > 0 else f"waiting for parts ({self.joined + 1} of {self.opts.parts})"
        return web.json_response({"error": {"message": f"{self.name} is {why}", "type": "server_error"}},
                                 status=503, headers=self._headers)

    async def part(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Another node's part joined; losing it later takes this head down, as a lost Ray worker takes vLLM."""
        self.joined += 1
        writer.write(b"ok\n")
        await writer.drain()
        await reader.read()  # until it goes away
        os._exit(4)

    @web.middleware
    async def _authorized(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """vLLM's AuthenticationMiddleware: /v1/… needs the key (compared in constant time); /health and
        /metrics do not."""
        if self.opts.api_key and request.path.startswith("/v1"):
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.opts.api_key.encode()):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._authorized, self._count])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/stats", self.stats)
        app.router.add_get("/metrics", self.metrics)
        self.adapters.routes(app)
        return app

    async def _begin(self, request: web.Request) -> _Body | web.Response:
        """Count the request, apply the injected faults, and decode the body."""
        self.requests += 1
        if (loading := self._loading()) is not None:
            return loading
        if self.opts.die_on_request:
            os._exit(3)  # like an engine that crashed: the connection drops with no byte sent
        if self.opts.refuse:
            return web.json_response(
                {"error": {"message": f"{self.name} refuses requests (--refuse)", "type": "server_error"}},
                status=503,
                headers=self._headers,
            )
        try:
            body = _DECODER.decode(await request.read())
        except msgspec.DecodeError as e:
            if "$.lora" in str(e):  # llama-server's words
                return web.json_response({"error": {"code": 400, "message": "Field 'lora': Error: 'lora' must be an "
                                                    "array of objects with 'id' and 'scale' fields",
                                                    "type": "invalid_request_error"}}, status=400)
            return web.json_response({"error": {"message": f"bad JSON: {e}", "type": "invalid_request_error"}}, status=400)
        if self.opts.latency_ms > 0:
            await asyncio.sleep(self.opts.latency_ms / 1000)
        return body

    async def _prefill_prompt(self, body: _Body, adapters: tuple[str, ...] = ()) -> dict[str, object]:
        """Take the prompt through the cache (and the prefill time of what it lacked); its usage."""
        text = body.text()
        prompt = max(1, len(text) // BYTES_PER_TOKEN)
        cached = min(self.cache.take(text, adapters), prompt)
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        if self.opts.prefill_ms_per_token > 0 and prompt > cached:
            async with self._prefill:
                await asyncio.sleep((prompt - cached) * self.opts.prefill_ms_per_token / 1000)
        return {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}}

    async def _completion(self, request: web.Request) -> tuple[_Body, _Answer] | web.Response:
        """A completion's body and who answers it: which adapters, under which model name."""
        body = await self._begin(request)
        if isinstance(body, web.Response):
            return body
        used = await self.adapters.serving(body.model, body.lora)
        if isinstance(used, web.Response):
            return used
        return body, _Answer(self, used, body.model if used and self.adapters.runtime else self.opts.model)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        got = await self._completion(request)
        if isinstance(got, web.Response):
            return got
        body, answer = got
        rid = f"chatcmpl-{self.name}-{self.requests}"
        prompt = await self._prefill_prompt(body, answer.adapters)
        if body.stream:
            return await self._stream(request, rid, "chat.completion.chunk", chat=True, body=body, prompt=prompt,
                                      answer=answer)
        reply = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": answer.model,
            "system_fingerprint": self.name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": answer.text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {**prompt, "completion_tokens": body.completion(3),
                      "total_tokens": int(prompt["prompt_tokens"]) + body.completion(3)},  # type: ignore[call-overload]
        }
        return web.Response(body=_ENCODER.encode(reply), content_type="application/json", headers=answer.headers)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        got = await self._completion(request)
        if isinstance(got, web.Response):
            return got
        body, answer = got
        rid = f"cmpl-{self.name}-{self.requests}"
        prompt = await self._prefill_prompt(body, answer.adapters)
        if body.stream:
            return await self._stream(request, rid, "text_completion", chat=False, body=body, prompt=prompt,
                                      answer=answer)
        reply = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": answer.model,
            "system_fingerprint": self.name,
            "choices": [{"index": 0, "text": answer.text, "finish_reason": "stop", "logprobs": None}],
            "usage": {**prompt, "completion_tokens": body.completion(3),
                      "total_tokens": int(prompt["prompt_tokens"]) + body.completion(3)},  # type: ignore[call-overload]
        }
        return web.Response(body=_ENCODER.encode(reply), content_type="application/json", headers=answer.headers)

    async def _stream(self, request: web.Request, rid: str, obj: str, *, chat: bool, body: _Body,
                      prompt: dict[str, object], answer: _Answer) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **answer.headers})
        await resp.prepare(request)
        created = int(time.time())
        pause = self.opts.chunk_interval_ms / 1000
        chunks = body.completion(self.opts.chunks)  # a token a chunk
        for i in range(chunks + 1):
            if 0 <= self.opts.die_after_chunks <= i:
                await asyncio.sleep(0.05)  # let the chunks leave the socket before the crash
                os._exit(3)
            last = i == chunks
            text = "" if last else f"tok{i} "
            choice: dict[str, object] = {"index": 0, "finish_reason": "stop" if last else None}
            if chat:
                choice["delta"] = {"role": "assistant", "content": text} if i == 0 else {"content": text}
            else:
                choice["text"] = text
            chunk = {"id": rid, "object": obj, "created": created, "model": answer.model,
                     "system_fingerprint": self.name, "choices": [choice]}
            await resp.write(b"data: " + _ENCODER.encode(chunk) + b"\n\n")
            if pause > 0 and not last:
                await asyncio.sleep(pause)
        if self.opts.force_include_usage or (body.stream_options is not None and body.stream_options.include_usage):
            # As OpenAI and vLLM do: one more chunk, with no choices, carrying the whole request's usage.
            n = int(prompt["prompt_tokens"])  # type: ignore[call-overload]
            usage = {**prompt, "completion_tokens": chunks, "total_tokens": n + chunks}
            await resp.write(b"data: " + _ENCODER.encode({"id": rid, "object": obj, "created": created,
                                                          "model": answer.model, "choices": [],
                                                          "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        if self.opts.done_linger_ms > 0:
            await asyncio.sleep(self.opts.done_linger_ms / 1000)
        await resp.write_eof()
        return resp

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        body = await self._begin(request)
        if isinstance(body, web.Response):
            return body
        inputs = body.input if isinstance(body.input, list) and body.input and not isinstance(body.input[0], int) else [body.input]
        dim = self.opts.embedding_dim
        data = [
            {"object": "embedding", "index": i, "embedding": [float((i + j) % 7) / 7 for j in range(dim)]}
            for i in range(len(inputs))
        ]
        reply = {
            "object": "list",
            "data": data,
            "model": self.opts.model,
            "replica": self.name,
            "usage": {"prompt_tokens": len(inputs), "total_tokens": len(inputs)},
        }
        return web.Response(body=_ENCODER.encode(reply), content_type="application/json", headers=self._headers)

    async def models(self, request: web.Request) -> web.Response:
        base = {"id": self.opts.model, "object": "model", "created": 0, "owned_by": self.name}
        return web.json_response({"object": "list", "data": [base, *self.adapters.cards()]})

    async def health(self, request: web.Request) -> web.Response:
        return self._loading() or web.Response(text="ok")

    async def metrics(self, request: web.Request) -> web.Response:
        """vLLM's cache_config_info line (an agent reads what this engine reserved as it reads vLLM's), its
        requests in flight (vLLM's name), and how long it has had any: the simulated GPUs' utilization."""
        lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
                 "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running {self.running}",
                 "# HELP llmgw_fake_busy_seconds_total Seconds with at least one request in flight.",
                 "# TYPE llmgw_fake_busy_seconds_total counter",
                 f"llmgw_fake_busy_seconds_total {self.busy_seconds():.6f}",
                 "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                 "# TYPE vllm:cache_config_info gauge"]
        if self.opts.kv_tokens > 0:
            lines.append(f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",'
                         f'num_gpu_blocks="{self.opts.kv_tokens // 16}"}} 1.0')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"name": self.name, "requests": self.requests, "prompt_tokens": self.prompt_tokens,
                                  "cached_tokens": self.cached_tokens, "request_ids": list(self.request_ids),
                                  "traceparents": list(self.traceparents),
                                  **self.adapters.stats()})


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, bound before the server starts so port 0 can be reported."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


async def serve(opts: EngineOptions, sock: socket.socket, host: str = "127.0.0.1") -> None:
    """Serve on an already bound socket until cancelled (and, for a head of several parts, their rendezvous)."""
    engine = FakeEngine(opts)
    runner = web.AppRunner(engine.app(), access_log=None, handle_signals=False)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    rendezvous = await asyncio.start_server(engine.part, host, opts.rendezvous_port) if opts.parts > 1 else None
    try:
        await asyncio.Event().wait()
    finally:
        if rendezvous is not None:
            rendezvous.close()
        await runner.cleanup()


async def join(address: str, name: str, within_s: float = 120.0) -> None:
    """A worker part: connect to the head's rendezvous, say so, and hold until the head goes away."""
    host, _, port = address.rpartition(":")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        try:
            reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
            break
        except OSError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.2)
    await reader.readline()
    print(f"joined {address} as {name}", flush=True)
    await reader.read()  # the head went away: so does this part
    writer.close()


@dataclass
class EngineProcess:
    """A ``llmgw fake-engine`` child process and the URL it printed."""

    proc: subprocess.Popen[bytes]
    url: str

    def stop(self) -> None:
        """Kill it (it holds no state worth a graceful stop) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def spawn(model: str, *args: str, name: str = "", host: str = "127.0.0.1", timeout: float = 20.0) -> EngineProcess:
    """Start ``llmgw fake-engine`` on a free port and wait (bounded) for its URL line."""
    cmd = [sys.executable, "-m", "llmgw", "fake-engine",
           "--host", host, "--port", "0", "--model", model, *(("--name", name) if name else ()), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout)
    line = proc.stdout.readline().decode().strip() if ready else ""
    if not line.startswith("http"):
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()
        raise RuntimeError(f"fake engine {name or model} did not print its URL within {timeout:.0f}s (exit {proc.poll()})")
    return EngineProcess(proc, line)
