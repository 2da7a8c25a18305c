"""The OpenAI API's own shapes the router answers with: error documents and model objects."""

from __future__ import annotations

import msgspec
from aiohttp import web

_ENC = msgspec.json.Encoder()


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


def model_object(name: str, state: str, created: int = 0) -> dict[str, object]:
    """One model of GET /v1/models: ``created`` is when it was declared (Unix seconds), as OpenAI's."""
    return {"id": name, "object": "model", "created": created, "owned_by": "llmgw", "state": state}
