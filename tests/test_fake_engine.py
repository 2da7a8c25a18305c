"""The fake engine as the router and the simulated agents see it: a real process on a real port."""

from __future__ import annotations

import asyncio

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
