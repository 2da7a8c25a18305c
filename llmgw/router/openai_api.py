"""The OpenAI API's own shapes the router answers with: error documents, model objects, usage chunks."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

_ENC = msgspec.json.Encoder()


class Head(msgspec.Struct):
    """The only fields the router reads from a request body."""

    model: str = ""
    stream: bool = False
    # Read, never judged: the engine answers a malformed one as it sees fit.
    stream_options: Any = None
    max_tokens: Any = None  # what a request may cost is reserved from its key's quota (llmgw/router/quotas.py)
    max_completion_tokens: Any = None
    n: Any = None

    def wants_usage(self) -> bool:
        """Whether the client asked for the usage chunk (``stream_options.include_usage``)."""
        return isinstance(self.stream_options, dict) and self.stream_options.get("include_usage") is True

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


def usage_asked(body: bytes, head: Head) -> bytes:
    """A streamed request's body that asks the engine for the usage chunk, which the client did not.

    The router counts every stream's tokens, so it asks for them as vLLM and llama-server
    take it (``stream_options.include_usage``) and takes the chunk out of what the client
    reads (``without_usage_chunks``). Without ``stream_options`` the field is put before
    the object's closing brace, so nothing of the body is parsed again or copied twice; with
    it (``{"include_usage": false}``, other options), the top level is read once as raw
    values and written back with ``include_usage`` set, the client's other options kept.
    """
    if head.stream_options is None and b'"stream_options"' not in body:
        end = body.rindex(b"}")
        opened = body[:end].rstrip().endswith(b"{")
        return body[:end] + (b"" if opened else b",") + _USAGE_ASKED + body[end:]
    top = _TOP.decode(body)
    options = head.stream_options if isinstance(head.stream_options, dict) else {}
    top["stream_options"] = msgspec.Raw(_ENC.encode({**options, "include_usage": True}))
    return _ENC.encode(top)


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
