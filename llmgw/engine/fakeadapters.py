"""The fake engine's LoRA adapters, held either way a real engine holds them.

vLLM (``max_loras`` > 0): loaded at runtime through ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``, with vLLM's replies to the byte, a request's ``model`` naming
one. llama.cpp (``attached``): fixed at start (``--lora``), ids 0..n-1, applied at the scales
a request's ``lora`` gives. What vLLM 0.32 and llama-server do was read from their sources
and tried on both (docs/engines.md, "LoRA adapters").
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import msgspec
from aiohttp import web

MAX_REGISTERED = 4096  # adapter names one fake vLLM keeps (vLLM's own dict has no bound)


class Lora(msgspec.Struct):
    """One entry of llama-server's per-request ``lora``: a missing id is -1, a missing scale 0, as there."""

    id: int = -1
    scale: float = 0.0


class _Load(msgspec.Struct):
    """vLLM's load and unload bodies (an unload gives the name only)."""

    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


_LOAD = msgspec.json.Decoder(_Load)


def vllm_error(message: str, kind: str, status: int, param: str | None = None) -> web.Response:
    """vLLM's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": status}},
                             status=status)


class Adapters:
    """The LoRA adapters of one fake engine, and what it counts of them.

    vLLM: the API server's names, each with the id of one load, and the worker's host-RAM
    cache of ``max_cpu_loras`` loaded weights, LRU. As in vLLM, loading never fails for want
    of room: the cache drops its least recently used (``evictions``), and one asked for again
    is read again (``reloads``, the load time again); unloading forgets the name only, its
    weights stay cached until dropped, and a name loaded again is a new load.
    llama.cpp: a request without ``lora`` (or with ``[]``) gets the start's scales, every one
    1.0; a list sets those it names and turns every other one off; unknown ids are ignored.
    """

    def __init__(self, model: str, *, max_loras: int = 0, max_cpu_loras: int = 0, load_ms: float = 0.0,
                 attached: tuple[str, ...] = ()) -> None:
        if max_loras and attached:
            raise ValueError("adapters are either loaded at runtime (vLLM's --max-loras) or attached (llama.cpp's --lora)")
        self.model, self.max_loras, self.load_ms, self.attached = model, max_loras, load_ms, attached
        self.capacity = max(max_cpu_loras, max_loras)
        self.names: dict[str, tuple[int, str]] = {}  # name → (load id, path)
        self.cache: OrderedDict[int, str] = OrderedDict()  # load id → name, least recently used first
        self.last_id = 0
        self.loads = self.reloads = self.evictions = self.unloads = 0
        self.requests: dict[str, int] = {}  # per adapter that answered
        self._lock = asyncio.Lock()  # one load at a time, as vLLM's engine core takes them

    @property
    def runtime(self) -> bool:
        return self.max_loras > 0

    def routes(self, app: web.Application) -> None:
        """What each engine serves of its adapters: vLLM registers its routes only where they load at runtime."""
        if self.runtime:
            app.router.add_post("/v1/load_lora_adapter", self.load)
            app.router.add_post("/v1/unload_lora_adapter", self.unload)
        if self.attached:
            app.router.add_get("/lora-adapters", self.listed)

    async def _read(self, load_id: int, name: str) -> None:
        """The load time, then the weights in the cache, its least recently used dropped when full."""
        async with self._lock:
            if self.load_ms > 0:
                await asyncio.sleep(self.load_ms / 1000)
            self.cache[load_id] = name
            self.cache.move_to_end(load_id)
            while len(self.cache) > self.capacity:
                self.cache.popitem(last=False)
                self.evictions += 1

    async def load(self, request: web.Request) -> web.Response:
        try:
            body = _LOAD.decode(await request.read())
        except msgspec.DecodeError as e:
            return vllm_error(f"1 validation error: {e}", "Bad Request", 400)
        name = body.lora_name
        if not name or not body.lora_path:
            return vllm_error("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
        if name == self.model:
            return vllm_error(f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput", 400)
        if name in self.names and not body.load_inplace:
            return vllm_error(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                              "in place, set 'load_inplace' to True.", "InvalidUserInput", 400)
        if name not in self.names and len(self.names) >= MAX_REGISTERED:
            return vllm_error(f"this fake engine keeps {MAX_REGISTERED} adapter names; unload one first",
                              "InvalidUserInput", 400)
        if name in self.names:
            load_id = self.names[name][0]
        else:
            self.last_id += 1
            load_id = self.last_id
        await self._read(load_id, name)
        self.names[name] = (load_id, body.lora_path)
        self.loads += 1
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        try:
            name = _LOAD.decode(await request.read()).lora_name
        except msgspec.DecodeError as e:
            return vllm_error(f"1 validation error: {e}", "Bad Request", 400)
        if not name:
            return vllm_error("'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput", 400)
        if name not in self.names:
            return vllm_error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
        del self.names[name]
        self.unloads += 1
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def serving(self, model: str, lora: list[Lora] | None) -> tuple[str, ...] | web.Response:
        """The adapters a request runs with (none: the base), or vLLM's 404 for a model it does not serve."""
        if self.runtime:
            if not model or model == self.model:
                return ()
            if model not in self.names:
                return vllm_error(f"The model `{model}` does not exist. Valid aliases: {self.model}.",
                                  "NotFoundError", 404, "model")
            load_id = self.names[model][0]
            if load_id in self.cache:
                self.cache.move_to_end(load_id)
            else:  # dropped from the cache: vLLM reads it again from its path
                self.reloads += 1
                await self._read(load_id, model)
            used: tuple[str, ...] = (model,)
        elif self.attached:
            scales = dict.fromkeys(range(len(self.attached)), 1.0)
            if lora:
                scales = dict.fromkeys(scales, 0.0) | {e.id: e.scale for e in lora if e.id in scales}
            used = tuple(self.attached[i] for i, scale in sorted(scales.items()) if scale != 0)
        else:
            return ()
        for name in used:
            self.requests[name] = self.requests.get(name, 0) + 1
        return used

    def cards(self) -> list[dict[str, object]]:
        """/v1/models entries of the loaded adapters, as vLLM lists them (llama-server lists none)."""
        return [{"id": name, "object": "model", "created": 0, "owned_by": "vllm", "root": path, "parent": self.model}
                for name, (_, path) in self.names.items()]

    async def listed(self, request: web.Request) -> web.Response:
        """llama-server's GET /lora-adapters: each attached adapter with its id and its start's scale."""
        return web.json_response([{"id": i, "path": name, "scale": 1.0, "task_name": "", "prompt_prefix": ""}
                                  for i, name in enumerate(self.attached)])

    def stats(self) -> dict[str, object]:
        return {"adapters": dict(self.requests), "loaded": list(self.names), "cached": len(self.cache),
                "loads": self.loads, "reloads": self.reloads, "evictions": self.evictions, "unloads": self.unloads}
