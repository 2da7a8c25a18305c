"""The fake engine as the router and the simulated agents see it: a real process on a real port."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from click.testing import CliRunner

from llmgw.cli.main import cli
from llmgw.engine.fake import spawn


async def test_answers_the_openai_routes_and_names_itself() -> None:
    eng = spawn("m1", "--chunks", "3", name="rep-1")
    try:
        async with openai.AsyncOpenAI(base_url=eng.url + "/v1", api_key="x", max_retries=0, timeout=10) as c:
            chat = await c.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
            assert chat.system_fingerprint == "rep-1"
            assert chat.choices[0].message.content == "hello from rep-1"
            stream = await c.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}], stream=True)
            chunks = [ch async for ch in stream]
            assert [ch.choices[0].delta.content for ch in chunks] == ["tok0 ", "tok1 ", "tok2 ", ""]
            assert chunks[-1].choices[0].finish_reason == "stop"
            text = await c.completions.create(model="m1", prompt="hi")
            assert text.choices[0].text == "hello from rep-1"
            emb = await c.embeddings.create(model="m1", input="one")
            assert len(emb.data) == 1 and (emb.model_extra or {}).get("replica") == "rep-1"
            assert [x.id for x in (await c.models.list()).data] == ["m1"]
        async with aiohttp.ClientSession() as s:
            async with s.get(eng.url + "/health") as resp:
                assert resp.status == 200
            async with s.get(eng.url + "/stats") as resp:
                assert (await resp.json())["requests"] == 4
    finally:
        eng.stop()


async def test_a_stream_carries_usage_only_when_asked_and_no_more_tokens_than_max_tokens() -> None:
    """As vLLM and llama-server do: the usage chunk (no choices) only with stream_options.include_usage."""
    eng = spawn("mu", "--chunks", "5", name="usage")
    hi = [{"role": "user", "content": "hi"}]
    try:
        async with openai.AsyncOpenAI(base_url=eng.url + "/v1", api_key="x", max_retries=0, timeout=10) as c:
            plain = [ch async for ch in await c.chat.completions.create(model="mu", messages=hi, stream=True)]
            assert all(ch.choices and ch.usage is None for ch in plain) and len(plain) == 5 + 1
            asked = [ch async for ch in await c.chat.completions.create(
                model="mu", messages=hi, stream=True, max_tokens=2, stream_options={"include_usage": True})]
            assert [ch.choices[0].delta.content for ch in asked if ch.choices] == ["tok0 ", "tok1 ", ""]
            assert asked[-1].choices == [] and asked[-1].usage is not None
            assert asked[-1].usage.completion_tokens == 2
            short = await c.chat.completions.create(model="mu", messages=hi, max_tokens=1)
            assert short.usage is not None and short.usage.completion_tokens == 1
    finally:
        eng.stop()


async def test_refuse_answers_503() -> None:
    eng = spawn("m2", "--refuse", name="no")
    try:
        async with openai.AsyncOpenAI(base_url=eng.url + "/v1", api_key="x", max_retries=0, timeout=10) as c:
            with pytest.raises(openai.APIStatusError) as err:
                await c.chat.completions.create(model="m2", messages=[{"role": "user", "content": "hi"}])
        assert err.value.status_code == 503
    finally:
        eng.stop()


async def test_die_on_request_drops_the_connection_with_no_byte() -> None:
    eng = spawn("m3", "--die-on-request", name="dies")
    try:
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ServerDisconnectedError):
                await s.post(eng.url + "/v1/chat/completions", json={"model": "m3"})
        assert await asyncio.to_thread(eng.proc.wait, 10) == 3
    finally:
        eng.stop()


async def test_die_after_chunks_breaks_the_stream() -> None:
    eng = spawn("m4", "--chunks", "10", "--die-after-chunks", "3", name="brk")
    try:
        got = b""
        async with aiohttp.ClientSession() as s:
            resp = await s.post(eng.url + "/v1/chat/completions", json={"model": "m4", "stream": True})
            with pytest.raises(aiohttp.ClientPayloadError):
                async for piece in resp.content.iter_any():
                    got += piece
            resp.close()
        assert got.count(b"data: ") == 3 and b"[DONE]" not in got
    finally:
        eng.stop()


def test_cli_help_documents_the_stable_flags() -> None:
    res = CliRunner().invoke(cli, ["fake-engine", "--help"])
    assert res.exit_code == 0
    for flag in ("--host", "--port", "--model", "--latency-ms", "--chunks"):
        assert flag in res.output


def test_cli_port_in_use_is_an_error() -> None:
    eng = spawn("m5", name="busy")
    try:
        port = eng.url.rsplit(":", 1)[1]
        res = CliRunner().invoke(cli, ["fake-engine", "--port", port, "--model", "m5"])
        assert res.exit_code == 1
        assert "Error: cannot listen on 127.0.0.1:" in res.output and "--port 0" in res.output
    finally:
        eng.stop()


# --- LoRA adapters, as vLLM and llama-server hold them ------------------------------------------------


async def _post(s: aiohttp.ClientSession, url: str, body: object) -> tuple[int, str, dict[str, str]]:
    async with s.post(url, json=body) as resp:
        return resp.status, await resp.text(), dict(resp.headers)


def _chat(model: str, **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


async def test_a_fake_vllm_loads_serves_and_unloads_adapters_with_vllms_replies() -> None:
    """The bodies are vLLM 0.32's, as its CPU build answered them (docs/engines.md, "LoRA adapters")."""
    eng = spawn("base", "--max-loras", "1", "--lora-load-ms", "20", name="r1")
    u = eng.url
    try:
        async with aiohttp.ClientSession() as s:
            status, text, _ = await _post(s, u + "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": "/ad/a1"})
            assert (status, text) == (200, "Success: LoRA adapter 'a1' added successfully.")  # plain text, as vLLM's
            status, text, _ = await _post(s, u + "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": "/ad/a1"})
            assert (status, text) == (400, '{"error": {"message": "The lora adapter \'a1\' has already been loaded. '
                                           'If you want to load the adapter in place, set \'load_inplace\' to True.", '
                                           '"type": "InvalidUserInput", "param": null, "code": 400}}')
            status, text, headers = await _post(s, u + "/v1/chat/completions", _chat("a1"))
            reply = json.loads(text)
            assert status == 200 and reply["model"] == "a1" and headers["x-llmgw-adapter"] == "a1"
            assert reply["choices"][0]["message"]["content"] == "hello from r1 (adapter a1)"
            status, text, _ = await _post(s, u + "/v1/completions", {"model": "base", "prompt": "hi"})
            assert json.loads(text)["choices"][0]["text"] == "hello from r1"
            status, text, _ = await _post(s, u + "/v1/chat/completions", _chat("nx"))
            assert (status, json.loads(text)) == (404, {"error": {
                "message": "The model `nx` does not exist. Valid aliases: base.", "type": "NotFoundError",
                "param": "model", "code": 404}})
            async with s.get(u + "/v1/models") as resp:
                cards = {c["id"]: c for c in (await resp.json())["data"]}
            assert cards["a1"]["parent"] == "base" and cards["a1"]["root"] == "/ad/a1" and "parent" not in cards["base"]
            # A second at one slot: both stay served, as in vLLM, whose cache drops a1's weights and
            # reads them again when a1 is next asked for.
            assert (await _post(s, u + "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": "/ad/a2"}))[0] == 200
            assert (await _post(s, u + "/v1/chat/completions", _chat("a1")))[0] == 200
            status, text, _ = await _post(s, u + "/v1/unload_lora_adapter", {"lora_name": "a2"})
            assert (status, text) == (200, "Success: LoRA adapter 'a2' removed successfully.")
            status, text, _ = await _post(s, u + "/v1/unload_lora_adapter", {"lora_name": "a2"})
            assert (status, json.loads(text)["error"]["message"]) == (404, "The lora adapter 'a2' cannot be found.")
            assert (await _post(s, u + "/v1/chat/completions", _chat("a2")))[0] == 404
            status, text, _ = await _post(s, u + "/v1/load_lora_adapter", {"lora_name": "a3"})
            assert status == 400 and "Both 'lora_name' and 'lora_path' must be provided." in text
            async with s.get(u + "/stats") as resp:
                stats = await resp.json()
        assert stats["adapters"] == {"a1": 2} and stats["loaded"] == ["a1"]
        assert (stats["loads"], stats["reloads"], stats["evictions"], stats["unloads"]) == (2, 1, 2, 1)
    finally:
        eng.stop()


async def test_an_engine_without_adapter_slots_has_no_lora_routes_and_serves_any_model_name() -> None:
    eng = spawn("plain", name="p")
    try:
        async with aiohttp.ClientSession() as s:
            status, _, _ = await _post(s, eng.url + "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"})
            assert status == 404  # vLLM registers them only with VLLM_ALLOW_RUNTIME_LORA_UPDATING
            status, text, headers = await _post(s, eng.url + "/v1/chat/completions", _chat("whatever"))
            assert status == 200 and "x-llmgw-adapter" not in headers
    finally:
        eng.stop()


async def test_a_fake_llama_server_applies_its_attached_adapters_at_the_requests_scales() -> None:
    eng = spawn("base", "--lora", "sql", "--lora", "chat", name="l1")
    u = eng.url + "/v1/completions"

    async def answered(**extra: object) -> str:
        status, text, _ = await _post(s, u, {"prompt": "hi", **extra})
        assert status == 200, text
        return str(json.loads(text)["choices"][0]["text"])

    try:
        async with aiohttp.ClientSession() as s:
            # No list (or an empty one): the start's scales, every adapter at 1.0, as llama-server does.
            assert await answered() == "hello from l1 (adapters sql, chat)"
            assert await answered(lora=[]) == "hello from l1 (adapters sql, chat)"
            # A list sets those it names; every other one is off; an unknown id is ignored.
            assert await answered(lora=[{"id": 1, "scale": 0.5}, {"id": 7, "scale": 1}]) == "hello from l1 (adapter chat)"
            assert await answered(lora=[{"id": 0, "scale": 0}, {"id": 1, "scale": 0}]) == "hello from l1"
            assert await answered(lora=[{"id": 0}]) == "hello from l1"  # a missing scale is 0
            status, text, _ = await _post(s, u, {"prompt": "hi", "lora": 3})
            assert status == 400 and "'lora' must be an array of objects with 'id' and 'scale' fields" in text
            async with s.get(eng.url + "/lora-adapters") as resp:
                assert [(a["id"], a["path"]) for a in await resp.json()] == [(0, "sql"), (1, "chat")]
            async with s.get(eng.url + "/v1/models") as resp:
                assert [c["id"] for c in (await resp.json())["data"]] == ["base"]  # llama-server lists none
            async with s.get(eng.url + "/stats") as resp:
                assert (await resp.json())["adapters"] == {"sql": 2, "chat": 3}
    finally:
        eng.stop()


async def test_a_prompts_cached_blocks_are_its_adapters_own() -> None:
    eng = spawn("base", "--max-loras", "2", "--cache-slots", "4", name="c1")
    prompt = "the same long prompt " * 20
    try:
        async with aiohttp.ClientSession() as s:
            await _post(s, eng.url + "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": "/a1"})

            async def cached(model: str) -> int:
                _, text, _ = await _post(s, eng.url + "/v1/completions", {"model": model, "prompt": prompt})
                return int(json.loads(text)["usage"]["prompt_tokens_details"]["cached_tokens"])

            assert await cached("base") == 0
            assert await cached("base") > 0
            assert await cached("a1") == 0  # the same text under an adapter: another KV
            assert await cached("a1") > 0
    finally:
        eng.stop()


def test_cli_an_engine_is_vllm_like_or_llama_like_not_both() -> None:
    res = CliRunner().invoke(cli, ["fake-engine", "--model", "m", "--max-loras", "2", "--lora", "a"])
    assert res.exit_code == 2 and "--max-loras" in res.output and "give one" in res.output
