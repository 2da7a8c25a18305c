"""The one read of a request body (``openai_api.Head``): what it says on big and hostile bodies, and the
rewrites made from it (the usage asked for, llama-server's ``lora``) keep every other byte as sent."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from llmgw.router import openai_api as api
from llmgw.router import prefix as pr
from llmgw.router.adapters import lora_body

CHAT = "/v1/chat/completions"
BIG = "x" * 10_000_000


def top(body: bytes) -> list[tuple[str, Any]]:
    found: list[list[tuple[str, Any]]] = []
    json.loads(body, object_pairs_hook=lambda kv: found.append(kv) or dict(kv))
    return found[-1]  # the outermost object is the last one closed


def reference_key(route: str, body: bytes) -> int | None:
    """The key as prefix.py renders it, from the body decoded whole by Python's json (the engines' reading)."""
    data = json.loads(body)
    if route == CHAT:
        out = b""
        for msg in data["messages"]:
            out += b"<|" + msg.get("role", "").encode() + b"|>\n"
            c = msg.get("content")
            if isinstance(c, str):
                out += c.encode()[:pr.KEY_BYTES]
            elif isinstance(c, list):
                for part in c:
                    out += part["text"].encode()[:pr.KEY_BYTES] if part["type"] == "text" else f"<{part['type']}>".encode()
                    if len(out) >= pr.KEY_BYTES:
                        break
            out += b"\n"
            if len(out) >= pr.KEY_BYTES:
                break
        return pr._hash64(out[:pr.KEY_BYTES])
    return pr._hash64(data["prompt"].encode()[:pr.KEY_BYTES])


HOSTILE = {
    "model after a 10 MB prompt": json.dumps({"messages": [{"role": "user", "content": BIG}], "stream": True,
                                              "max_tokens": 7, "model": "late"}).encode(),
    "keys repeated (the last is the engine's)": b'{"model":"a","max_tokens":1,"stream":false,"messages":[{"role":"user",'
                                                b'"content":"hi"}],"model":"b","max_tokens":900,"stream":true}',
    "keys escaped": b'{"mod\\u0065l":"esc","str\\u0065am":true,"max_t\\u006fkens":5,"messages":[{"role":"user",'
                    b'"content":"hi"}]}',
    "model nested in messages and metadata": json.dumps({
        "metadata": {"model": "inner", "stream": False}, "model": "outer", "stream": True,
        "messages": [{"role": "user", "content": "hi", "model": "nested"}]}).encode(),
    "escapes at the key's edge": json.dumps({"model": "m", "messages": [
        {"role": "system", "content": "a" * 1021 + '"\\\U0001F600' + "tail" * 1000}]}).encode(),
    "surrogate pairs escaped, every one": json.dumps({"model": "m", "messages": [
        {"content": "\U0001F600" * 5000, "role": "user"}]}, ensure_ascii=True).encode(),
    "quotes and backslashes only": json.dumps({"model": "m", "messages": [
        {"role": "user", "content": '"\\' * 2_000_000}]}).encode(),
    "parts, then a 10 MB one": json.dumps({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}},
                                     {"type": "text", "text": "é" * 300}, {"type": "text", "text": BIG}]}]}).encode(),
}


@pytest.mark.parametrize("what", list(HOSTILE))
def test_the_head_reads_a_body_as_the_engine_does(what: str) -> None:
    body = HOSTILE[what]
    head = api.HEAD.decode(body)
    data = json.loads(body)  # Python's json keeps a repeated key's last value, as vLLM and llama-server do
    assert (head.model, head.stream, head.max_tokens) == (data["model"], data.get("stream", False),
                                                          data.get("max_tokens")), what
    assert pr.prompt_key(CHAT, head) == pr.prompt_key(CHAT, body) == reference_key(CHAT, body), what


def test_a_completions_prompt_is_keyed_on_its_first_kib_however_escaped() -> None:
    for prompt in (BIG, "\U0001F600" * 3000, '\\"' * 900 + "end", "short"):
        for ascii_only in (True, False):
            body = json.dumps({"model": "m", "prompt": prompt}, ensure_ascii=ascii_only).encode()
            assert pr.prompt_key("/v1/completions", body) == reference_key("/v1/completions", body)


ODD_NUMBERS = b'{"model":"m","temperature":1e999,"seed":123456789012345678901234567890,"top_p":1.00000000000000000001'


@pytest.mark.parametrize("tail", [b"}", b',"stream":true}', b',"messages":[{"role":"user","content":"x"}]}\n  '])
def test_a_lora_list_is_added_and_every_other_byte_kept(tail: bytes) -> None:
    """Was: the body decoded whole and encoded again: 1e999 a 500 (out of range), 1.000…1 sent as 1.0."""
    body = ODD_NUMBERS + tail
    head = api.HEAD.decode(body)
    sent = lora_body(body, ("a", "b"), "b", 0.5, head.sent_lora())
    assert sent.startswith(ODD_NUMBERS) and sent.rstrip().endswith(b"}")
    assert [k for k, _ in top(sent)].count("lora") == 1
    assert json.loads(sent)["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.5}]
    again = lora_body(sent, ("a", "b"), "a", 1.0)  # a retry: the body holds one, replaced, still one
    assert [k for k, _ in top(again)].count("lora") == 1 and json.loads(again)["lora"][0] == {"id": 0, "scale": 1.0}


def test_a_clients_own_lora_is_replaced_not_repeated() -> None:
    body = b'{"model":"m","lo\\u0072a":[{"id":0,"scale":9}],"messages":[]}'
    head = api.HEAD.decode(body)
    assert head.sent_lora()
    sent = lora_body(body, ("a",), "a", 1.0, head.sent_lora())
    assert [k for k, _ in top(sent)].count("lora") == 1 and json.loads(sent)["lora"] == [{"id": 0, "scale": 1.0}]


@pytest.mark.parametrize("body", [
    b'{"model":"q","stream":true,"stream\\u005foptions":null}',  # escaped: was a second stream_options put in
    b'{"model":"q","stream":true,"stream_options":{"include_usage":false},"stream_options":null}',
    b'{"model":"q","messages":[{"role":"user","content":"say \\"stream_options\\""}],"stream":true}',
    ODD_NUMBERS + b',"stream":true}',
])
def test_usage_is_asked_once_whatever_the_body_says(body: bytes) -> None:
    head = api.HEAD.decode(body)
    asked = api.usage_asked(body, head)
    keys = [k for k, _ in top(asked)]
    assert keys.count("stream_options") == 1 and json.loads(asked)["stream_options"]["include_usage"] is True
    if b"1e999" in body:  # nothing else of the body was parsed and written again
        assert asked.startswith(ODD_NUMBERS)


def test_a_body_that_is_not_one_object_is_refused_as_before() -> None:
    for bad in (b"[1]", b'{"model":"m"} {"model":"n"}', b'{"model":"m",', b'"m"'):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            api.HEAD.decode(bad)
