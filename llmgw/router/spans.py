"""OpenTelemetry spans for the requests the access log traces (the ``otel`` extra); the one module that imports it.

Per request on an OpenAI route, a ``SERVER`` span from its arrival to its last byte, and under
it, once a replica is asked, a ``CLIENT`` span for the replica with the engine's own timings
where it reports them (llama-server's ``timings``: prefill and decode ms). The replica span's
context goes to the engine as W3C ``traceparent``, so an engine that traces (vLLM with
``--otlp-traces-endpoint``) joins the same trace. Both carry the request id, so a trace and
an access-log line find each other. Exported over OTLP/HTTP (``--otlp-endpoint``) in batches,
off the event loop (the SDK's exporter thread).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmgw import messages as m
from llmgw.errors import ConfigError

if TYPE_CHECKING:
    from llmgw.router.access import Trace

SERVICE = "llmgw-router"


def otlp_provider(endpoint: str, router: str) -> Any:
    """A TracerProvider exporting to ``endpoint`` (a collector's OTLP/HTTP base URL) in batches."""
    if not endpoint.startswith(("http://", "https://")):
        raise ConfigError(f"--otlp-endpoint must be an http(s) URL, a collector's OTLP/HTTP base such as "
                          f"http://127.0.0.1:4318 (got {endpoint!r})")
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise ConfigError(f"--otlp-endpoint needs OpenTelemetry, which is not installed ({e.name}); "
                          "pip install 'llmgw[otel]'") from e
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE, "service.instance.id": router}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")))
    return provider


class Spans:
    """The two spans of each traced request, from a TracerProvider (``otlp_provider``, or a test's)."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self._trace = trace
        self._tracer = provider.get_tracer("llmgw.router")
        self._propagator = TraceContextTextMapPropagator()

    def _server(self, tr: Trace, name: str) -> Any:
        if tr.span is None:
            tr.span = self._tracer.start_span(name, kind=self._trace.SpanKind.SERVER, start_time=tr.at_ns,
                                              attributes={"llmgw.request_id": tr.id})
        return tr.span

    def engine(self, tr: Trace, route: str) -> dict[str, str]:
        """The replica's span begins (its engine is about to be asked); the headers that carry it there."""
        parent = self._trace.set_span_in_context(self._server(tr, f"POST {route}"))
        tr.replica_span = self._tracer.start_span("llmgw.replica", context=parent, kind=self._trace.SpanKind.CLIENT,
                                                  attributes={"llmgw.request_id": tr.id})
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(tr.replica_span))
        return carrier

    def end(self, tr: Trace, line: m.AccessLine) -> None:
        """Both spans end with what the access-log line says (a request no replica took has only the first)."""
        server = self._server(tr, f"POST {line.route}")
        server.set_attributes({
            "http.request.method": "POST", "url.path": line.route, "http.response.status_code": line.status,
            "llmgw.router": line.router, "llmgw.caller": line.caller, "gen_ai.request.model": line.model,
            "gen_ai.usage.input_tokens": line.prompt_tokens, "gen_ai.usage.output_tokens": line.completion_tokens,
            "llmgw.cached_tokens": line.cached_tokens, "llmgw.queue_ms": line.queue_ms, "llmgw.wake_ms": line.wake_ms,
            "llmgw.ttft_ms": line.ttft_ms, "llmgw.stream": line.stream,
            **({"error.type": line.error} if line.error else {}),
        })
        if line.status >= 500 or line.error:
            server.set_status(self._trace.Status(self._trace.StatusCode.ERROR, line.error or str(line.status)))
        if tr.replica_span is not None:
            tr.replica_span.set_attributes({
                "llmgw.replica": line.replica, "http.response.status_code": line.status,
                "llmgw.ttft_ms": line.ttft_ms, **{f"llmgw.engine.{k}": v for k, v in tr.engine_ms.items()},
            })
            if line.status >= 500 or line.error:
                tr.replica_span.set_status(self._trace.Status(self._trace.StatusCode.ERROR,
                                                              line.error or str(line.status)))
            tr.replica_span.end()
        server.end()

    def shutdown(self) -> None:
        """Export what is left (blocking: call it off the event loop)."""
        self.provider.shutdown()
