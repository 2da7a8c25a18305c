"""The router's front: which handler a request goes to, its id on every answer, its line once answered.

One handler for aiohttp's low-level ``web.Server``: no Application, URL dispatcher, middleware
chain or response signal, which a pass-through proxy does not pay for either (docs/benchmarks.md,
issue 46). What they did for the router is done here, once per request:

* the path is looked up in a dict (``/v1/models/NAME`` by its prefix, a name may hold a slash);
  anything else goes to ``Gateway.no_route``, an OpenAI-style 404 or 405; a GET route takes HEAD too;
* ``Expect: 100-continue`` is answered before the handler reads the body (as aiohttp's router did);
* the request's ``Call`` is made (its id: ``access.request_id``) and every answer the handlers
  return unsent is given ``x-request-id`` in its head and, an error, in its body (a stream's head
  is stamped by the gateway, which sends it), aiohttp's 500 for an exception a handler let out too;
* with ``--access-log`` or ``--otlp-endpoint``, the line is written and the spans end once the
  answer is out.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.http import HttpVersion11

from llmgw.router import access
from llmgw.router import openai_api as api
from llmgw.router.access import HEADER, Call, Trace
from llmgw.router.gateway import ROUTES, Gateway

if TYPE_CHECKING:
    from llmgw.router.spans import Spans

log = logging.getLogger(__name__)

_MODEL = "/v1/models/"


class Front:
    """The one request handler of the router's listener."""

    def __init__(self, gateway: Gateway, access_log: access.AccessLog | None, router: str, static_keys: bool,
                 spans: Spans | None) -> None:
        self.gateway = gateway
        self.access_log = access_log
        self.router = router
        self.static_keys = static_keys
        self.spans = spans
        self._posts = {route: route for route in ROUTES}
        self._gets: dict[str, Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]] = {
            "/v1/models": gateway.models, "/health": gateway.health, "/metrics": gateway.render_metrics,
        }

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        call = Call(Trace(access.request_id(request.headers.get(HEADER)), self.spans))
        tr = call.trace
        try:
            try:
                if request.headers.get("Expect") and (refused := await self._expect(request)) is not None:
                    resp: web.StreamResponse = refused
                else:
                    resp = await self._route(request, call)
            except TimeoutError:  # aiohttp's answers to what a handler let out, as it would give them, stamped
                resp = request.protocol.handle_error(request, 504)
            except Exception as e:  # noqa: BLE001 - logged with its traceback by handle_error
                resp = request.protocol.handle_error(request, 500, e)
            if not resp.prepared:
                tr.error = access.with_request_id(resp, tr.id) or tr.error
                resp.headers[HEADER] = tr.id
            return resp
        finally:
            if tr.logged and (self.access_log is not None or self.spans is not None):
                self._ended(request, call)

    def _route(self, request: web.BaseRequest, call: Call) -> Awaitable[web.StreamResponse]:
        path, method = request.path, request.method
        route = self._posts.get(path)
        if route is not None:
            if method == "POST":
                return self.gateway.proxy(request, call, route)
        elif method == "GET" or method == "HEAD":
            get = self._gets.get(path)
            if get is not None:
                return get(request)
            if path.startswith(_MODEL) and len(path) > len(_MODEL):
                return self.gateway.model(request, path[len(_MODEL):])
        return self.gateway.no_route(request)

    @staticmethod
    async def _expect(request: web.BaseRequest) -> web.StreamResponse | None:
        """``Expect: 100-continue`` answered at once (HTTP/1.1), so the client sends its body; another a 417."""
        expect = request.headers.get("Expect", "")
        if request.version != HttpVersion11:
            return None
        if expect.lower() != "100-continue":
            return api.error(417, f"unknown Expect: {expect[:64]!r}; only 100-continue is understood",
                             "invalid_request_error", "expectation_failed")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # what counts as the answer starts after the interim one
        await request.writer.drain()
        return None

    def _ended(self, request: web.BaseRequest, call: Call) -> None:
        line = access.line_of(call, request, self.router, self.static_keys)
        if self.access_log is not None:
            self.access_log.write(line)
        if self.spans is not None:
            try:
                self.spans.end(call.trace, line)
            except Exception as e:  # a tracer's failure must not become the request's  # noqa: BLE001
                log.warning("router %s: spans of request %s not ended: %s", self.router, call.trace.id, e)
