"""The OpenAI API's own shapes the router answers with: error documents, model objects, usage chunks."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

_ENC = msgspec.json.Encoder()


_ABSENT = msgspec.Raw(b"")


class Head(msgspec.Struct):
    """The only fields the router reads from a request body: one pass over it, nothing else decoded.

    msgspec reads the body once, as its C parser skips what no field names, and keeps
    ``messages`` and ``prompt`` as raw slices of the body, so a 30 MB prompt is never made
    into a string: the routing key reads its first KiB from those slices
    (``prefix.prompt_key``), and the body is rewritten, where it must be, without being
    parsed again (``usage_asked``, ``adapters.lora_body``). A key the body repeats is read
    as its last, as the engines read it (Python's json, nlohmann's).
    """

    model: str = ""
    stream: bool = False
    # Read, never judged: the engine answers a malformed one as it sees fit. UNSET: not in the body.
    stream_options: Any = msgspec.UNSET
    max_tokens: Any = None  # what a request may cost is reserved from its key's quota (llmgw/router/quotas.py)
    max_completion_tokens: Any = None
    n: Any = None
    lora: msgspec.Raw = _ABSENT  # llama-server's adapters; only whether the client sent one is read
    # Chat messages, each a raw slice; another type is the engine's to refuse (and no routing key).
    messages: list[msgspec.Raw] | str | int | float | bool | dict[str, msgspec.Raw] | None = None
    prompt: msgspec.Raw = _ABSENT  # a completion's prompt, raw

    def wants_usage(self) -> bool:
        """Whether the client asked for the usage chunk (``stream_options.include_usage``)."""
        return isinstance(self.stream_options, dict) and self.stream_options.get("include_usage") is True

    def sent_lora(self) -> bool:
        return len(self.lora) > 0

    def completion_cap(self) -> int | None:
        """The most completion tokens the request may be answered with, when it says (``max_tokens`` × ``n``)."""
        cap = next((v for v in (self.max_completion_tokens, self.max_tokens)
                    if isinstance(v, int) and not isinstance(v, bool) and v >= 0), None)
        if cap is None:
            return None
        n = self.n if isinstance(self.n, int) and not isinstance(self.n, bool) and self.n > 1 else 1
        return cap * n


HEAD = msgspec.json.Decoder(Head)
_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_USAGE_ASKED = b'"stream_options":{"include_usage":true}'
_SPACE = b" \t\r\n"


def with_field(body: bytes, name: str, value: bytes, present: bool) -> bytes:
    """``body`` with its top-level ``name`` set to the JSON ``value``, everything else as sent.

    Not ``present`` (the head says the body has no such key), the field is put before the
    object's closing brace: one copy, nothing parsed. Present, the top level is read once as
    raw values and written back with ``name`` replaced (a repeated key then once, as the
    engine would have read it: its last).
    """
    if not present:
        end = body.rindex(b"}")
        i = end - 1
        while i > 0 and body[i] in _SPACE:
            i -= 1
        comma = b"" if body[i] == ord("{") else b","
        view = memoryview(body)
        return b"".join((view[:end], comma, b'"', name.encode(), b'":', value, view[end:]))
    top = _TOP.decode(body)
    top[name] = msgspec.Raw(value)
    return _ENC.encode(top)


def usage_asked(body: bytes, head: Head) -> bytes:
    """A streamed request's body that asks the engine for the usage chunk, which the client did not.

    The router counts every stream's tokens, so it asks for them as vLLM and llama-server
    take it (``stream_options.include_usage``) and takes the chunk out of what the client
    reads (``without_usage_chunks``). The client's other options are kept.
    """
    options = head.stream_options if isinstance(head.stream_options, dict) else {}
    return with_field(body, "stream_options", _ENC.encode({**options, "include_usage": True}),
                      head.stream_options is not msgspec.UNSET)


def error_body(message: str, type_: str, code: str, param: str | None = None) -> bytes:
    """An OpenAI-style error document, so clients raise their usual exceptions."""
    return _ENC.encode({"error": {"message": message, "type": type_, "param": param, "code": code}})


def error(status: int, message: str, type_: str, code: str, param: str | None = None,
           headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=error_body(message, type_, code, param),
                        content_type="application/json", headers=headers)


def unauthorized() -> web.Response:
    return error(401, "missing or invalid API key; send `Authorization: Bearer <key>`",
                  "invalid_request_error", "invalid_api_key")


def model_object(name: str, state: str, created: int = 0, parent: str | None = None) -> dict[str, object]:
    """One model of GET /v1/models: ``created`` is when it was declared (Unix seconds), as OpenAI's;
    a LoRA adapter names its base as ``parent`` (as vLLM lists its adapters)."""
    out: dict[str, object] = {"id": name, "object": "model", "created": created, "owned_by": "llmgw", "state": state}
    if parent is not None:
        out["parent"] = parent
    return out


_NO_CHOICES = b'"choices":[]'


def without_usage_chunks(data: bytes) -> tuple[bytes, bytes]:
    """A stream's bytes less the usage-only events (no choices), and an unfinished last event held back.

    The router asks every stream for one (``usage_asked``), and a vLLM started with
    ``--enable-force-include-usage`` ends every stream with one anyway, so that the router
    can count it; a client that did not ask for usage
    (``stream_options.include_usage``) never expected one, and code that reads
    ``choices[0]`` of every chunk breaks on it. Bytes without the marker pass as they are
    (the common case: nothing is parsed or held).
    """
    if _NO_CHOICES not in data:
        return data, b""
    *events, rest = data.split(b"\n\n")
    kept = [e for e in events if not (_NO_CHOICES in e and b'"usage"' in e and e.lstrip().startswith(b"data: {"))]
    return b"".join(e + b"\n\n" for e in kept), rest
