"""The router and LoRA adapters: a request naming an adapter reaches only a replica holding it.

Real NATS, the real router, fake engines holding adapters as vLLM does (loaded at
runtime, ``--max-loras``) and as llama-server does (attached at start, ``--lora``).
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import aiohttp
import openai
from running import engines as running_engines
from test_agent import stream_events
from test_router import in_pool

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.router.server import Router


def now() -> datetime:
    return datetime.now(UTC)


def base_spec(name: str, engine: str, **kw: object) -> m.ModelSpec:
    return m.ModelSpec(name=name, source=f"./{name}", precision="bf16" if engine == "vllm" else "q8_0",
                       engine=engine, gpu_class="L4-24GB", context=2048, **kw)  # type: ignore[arg-type]


async def declare(bus: Bus, spec: m.ModelSpec, adapters: list[str]) -> None:
    await bus.publish(m.ModelDeclared(at=now(), spec=spec))
    for name in adapters:
        await bus.publish(m.AdapterDeclared(at=now(), spec=m.AdapterSpec(
            name=name, base=spec.name, source=f"./{name}", path=f"/adapters/{name}",
            format="peft" if spec.engine == "vllm" else "gguf", rank=8, alpha=16)))


async def run(bus: Bus, rid: str, spec: m.ModelSpec, url: str) -> None:
    await bus.publish(m.ReplicaPlaced(at=now(), replica_id=rid, model=spec.name, nodes=("n1",), spec=spec,
                                      gpus=(m.GpuRef(node="n1", index=0, uuid="GPU-0", mib=4096),), fabric="f"))
    await bus.publish(m.ReplicaStateChanged(at=now(), replica_id=rid, model=spec.name, node="n1", state="healthy",
                                            endpoint=url))


async def stats(url: str) -> dict:  # type: ignore[type-arg]
    async with aiohttp.ClientSession() as s, s.get(url + "/stats") as r:
        return json.loads(await r.text())


async def chat(client: openai.AsyncOpenAI, model: str) -> tuple[str, str]:
    """The answer's text and the replica that gave it."""
    raw = await client.chat.completions.with_raw_response.create(model=model, messages=[{"role": "user", "content": "hi"}])
    reply = raw.parse()
    return reply.choices[0].message.content or "", raw.headers.get("x-llmgw-replica", "")


async def test_vllm_replicas_load_adapters_where_asked_and_never_serve_one_they_lack(bus: Bus) -> None:
    spec = base_spec("base", "vllm", max_adapters=1, max_lora_rank=16)
    slots = ("base", "--max-loras", "1", "--lora-load-ms", "150")
    with running_engines(A=slots, B=slots) as procs:
        r = Router(bus, "router-lora", tick_s=3600)
        await r.start("127.0.0.1", 0)
        try:
            await declare(bus, spec, ["sql", "law", "med"])
            await run(bus, "base-r1", spec, procs["A"].url)
            await run(bus, "base-r2", spec, procs["B"].url)
            await r.sink.wait_for(in_pool("base-r1", "base-r2"))
            await r.sink.wait_for(lambda pool: len(pool.adapters) == 3)
            async with openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="-", max_retries=0, timeout=20) as c:
                # Ten at once for an adapter nobody holds: one load, on one replica, and every one answered by it.
                answers = await asyncio.gather(*(chat(c, "sql") for _ in range(10)))
                assert {who for _, who in answers} == {answers[0][1]} and all("sql" in text for text, _ in answers)
                first = answers[0][1]
                a, b = await stats(procs["A"].url), await stats(procs["B"].url)
                assert a["loads"] + b["loads"] == 1
                # Another adapter goes to the replica with room; the first keeps sql.
                text, who = await chat(c, "law")
                assert "law" in text
                # A third, on replicas at --max-adapters (one each): the least recently used is unloaded first.
                for name in ("med", "sql", "law", "med"):
                    text, who = await chat(c, name)
                    assert name in text, (name, text)
                models = {x.id: x for x in (await c.models.list()).data}
                assert {"sql", "law", "med", "base"} <= set(models)
                assert (models["sql"].model_extra or {}).get("parent") == "base"
            # Nothing was ever sent to a replica without its adapter: the engine's 404 is what would say so.
            assert r.gateway.adapters.missing == 0
            served = [await stats(url) for url in (procs["A"].url, procs["B"].url)]
            assert sum(sum(s["adapters"].values()) for s in served) == 10 + 1 + 4
            events = [e for e in await stream_events(bus, subjects.STREAM_USAGE)
                      if isinstance(e, m.AdapterLoaded | m.AdapterUnloaded) and e.router == "router-lora"]
            assert sum(isinstance(e, m.AdapterLoaded) for e in events) >= 3
            assert any(isinstance(e, m.AdapterUnloaded) for e in events)
            assert first in {"base-r1", "base-r2"}
        finally:
            await r.stop()


async def test_llama_cpp_replicas_get_the_complete_lora_list_and_the_base_none(bus: Bus) -> None:
    attached = (m.AdapterRef(name="sql", path="/a/sql.gguf"), m.AdapterRef(name="law", path="/a/law.gguf"))
    spec = base_spec("tiny", "llama.cpp", adapters=attached)
    old = base_spec("tiny", "llama.cpp")  # a replica placed before the adapters were declared
    with running_engines(A=("tiny", "--lora", "sql", "--lora", "law"), B=("tiny",)) as procs:
        r = Router(bus, "router-lora-cpp", tick_s=3600)
        await r.start("127.0.0.1", 0)
        try:
            await declare(bus, spec, ["sql", "law"])
            await run(bus, "tiny-r1", spec, procs["A"].url)
            await run(bus, "tiny-r2", old, procs["B"].url)
            await r.sink.wait_for(in_pool("tiny-r1", "tiny-r2"))
            async with openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="-", max_retries=0, timeout=20) as c:
                for name in ("sql", "law", "sql"):
                    text, who = await chat(c, name)
                    assert who == "tiny-r1" and name in text and ({"sql", "law"} - {name}).pop() not in text
                # The base's own requests: every attached adapter at 0 (llama-server applies them otherwise).
                for _ in range(4):
                    text, _ = await chat(c, "tiny")
                    assert "adapter" not in text, text
        finally:
            await r.stop()
