"""The router's Prometheus metrics: one ``prometheus_client`` registry per router.

Counters and histograms are updated as requests finish; the pool's gauges
(in flight, replicas by state) and the control-stream counters are read at
scrape time by a collector, so a scrape shows the pool as it is, with no
second copy of it to keep in step. ``render`` answers in the format the
scraper's ``Accept`` header asks for (OpenMetrics or the 0.0.4 text format).
Every metric is listed in docs/router.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated, Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from llmgw.router.endpoints import Pool

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
WAKE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# Every kind ``Metrics.error`` is called with (docs/router.md documents each).
ERROR_KINDS = ("bad_request", "too_large", "body_timeout", "unauthorized", "forbidden_model", "rate_limited",
               "quota_exceeded", "shed", "unknown_model", "no_replica",
               "wake_timeout", "unplaceable", "stopped", "upstream_connect", "upstream_timeout", "upstream_broken",
               "client_closed", "adapter_not_attached", "adapter_load_failed", "adapter_slots_busy")

_Tokens = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]  # an engine's count; a negative or absurd one is refused


class _PromptDetails(msgspec.Struct):
    cached_tokens: _Tokens = 0


class Usage(msgspec.Struct):
    """The token counts an engine reports in ``usage`` (embeddings have no completion tokens).

    ``cached_tokens`` are prompt tokens the engine served from its cache: vLLM's
    ``usage.prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``), or
    llama-server's ``timings.cache_n`` (``usage_of`` moves it here).
    """

    prompt_tokens: _Tokens = 0
    completion_tokens: _Tokens = 0
    prompt_tokens_details: _PromptDetails | None = None
    timings: _Timings | None = None  # llama-server's, beside its usage (``usage_of`` puts them here)

    @property
    def cached_tokens(self) -> int:
        details = self.prompt_tokens_details
        return min(details.cached_tokens, self.prompt_tokens) if details is not None else 0


class _Timings(msgspec.Struct):
    """llama-server's ``timings``: what its slot took from the cache, and how long prefill and decode took."""

    cache_n: _Tokens = 0  # llama-server: prompt tokens taken from the slot's cache
    # Unbounded: only shown (a span's attributes), and a figure out of any bound must not lose the count.
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0


class _WithUsage(msgspec.Struct):
    usage: Usage | None = None
    timings: _Timings | None = None


_USAGE = msgspec.json.Decoder(_WithUsage)


def usage_of(body: bytes) -> Usage | None:
    """The ``usage`` of a JSON answer (or one streamed chunk's data), or None when it has none or is not JSON."""
    try:
        got = _USAGE.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return _with_cache_n(got.usage, got.timings)


def _with_cache_n(usage: Usage | None, timings: _Timings | None) -> Usage | None:
    """``usage`` with llama-server's ``timings.cache_n`` as its cached tokens, when it says none itself."""
    if usage is not None and timings is not None and usage.prompt_tokens_details is None:
        usage.prompt_tokens_details = _PromptDetails(cached_tokens=timings.cache_n)
    if usage is not None and timings is not None:
        usage.timings = timings
    return usage


def usage_of_stream(tail: bytes) -> Usage | None:
    """The last ``usage`` in the tail of a server-sent event stream (the engine sends it last, before [DONE])."""
    usage: Usage | None = None
    timings: _Timings | None = None
    for event in reversed(tail.split(b"\n\n")):
        data = event.strip()
        if not data.startswith(b"data:") or (b'"usage"' not in data and b'"timings"' not in data):
            continue
        try:
            got = _USAGE.decode(data[5:])
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        usage, timings = usage or got.usage, timings or got.timings  # llama-server may send them apart
        if usage is not None and (timings is not None or usage.prompt_tokens_details is not None):
            break
    return _with_cache_n(usage, timings)


class _PoolCollector:
    """The gauges and counters that live in the router's own state, read at scrape time."""

    def __init__(self, pool: Pool, bad_events: Callable[[], int], idle_maps: Callable[[], int]) -> None:
        self.pool, self.bad_events, self.idle_maps = pool, bad_events, idle_maps

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names are only known at collect time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily("llmgw_router_in_flight", "Requests in flight per replica.",
                                      labels=["replica", "model"])
        per_model: dict[str, int] = {}
        for r in sorted(self.pool.replicas.values(), key=lambda r: r.replica_id):
            in_flight.add_metric([r.replica_id, r.model], r.outstanding)
            per_model[r.model] = per_model.get(r.model, 0) + r.outstanding
        yield in_flight
        model_in_flight = GaugeMetricFamily("llmgw_router_model_in_flight", "Requests in flight per model.",
                                            labels=["model"])
        for model, n in sorted(per_model.items()):
            model_in_flight.add_metric([model], n)
        yield model_in_flight
        replicas = GaugeMetricFamily("llmgw_router_replicas", "Replicas this router knows, by state.", labels=["state"])
        for state, n in sorted(self.pool.states().items()):
            replicas.add_metric([state], n)
        yield replicas
        yield CounterMetricFamily("llmgw_router_bad_events",
                                  "Control events skipped: undecodable, or refused (a node speaking for another).",
                                  value=self.bad_events())
        yield CounterMetricFamily("llmgw_router_idle_maps", "Idle maps published.", value=self.idle_maps())


class Metrics:
    """One router's metrics in their own registry (two routers in one process never share a count)."""

    def __init__(self, pool: Pool | None = None, bad_events: Callable[[], int] = lambda: 0,
                 idle_maps: Callable[[], int] = lambda: 0, *, process: bool = True) -> None:
        self.registry = r = CollectorRegistry()
        self._requests = Counter("llmgw_router_requests", "Requests answered, by model, route and status.",
                                 ["model", "route", "code"], registry=r)
        self._errors = Counter("llmgw_router_errors", "Requests that failed, by model and kind.",
                               ["model", "kind"], registry=r)
        self._retries = Counter("llmgw_router_retries",
                                "Requests retried on another replica after a connection failure.", registry=r)
        self._latency = Histogram("llmgw_router_request_seconds",
                                  "Time from request to the last byte, by model and stream.",
                                  ["model", "stream"], buckets=LATENCY_BUCKETS, registry=r)
        self._ttft = Histogram("llmgw_router_time_to_first_token_seconds",
                               "Streamed requests: time from request to the engine's first chunk, by model.",
                               ["model"], buckets=TTFT_BUCKETS, registry=r)
        self._prompt = Counter("llmgw_router_prompt_tokens", "Prompt tokens the engines reported in `usage`, by model.",
                               ["model"], registry=r)
        self._completion = Counter("llmgw_router_completion_tokens",
                                   "Completion tokens the engines reported in `usage`, by model.", ["model"], registry=r)
        self._cached = Counter("llmgw_router_prompt_tokens_cached",
                               "Prompt tokens the engines served from their prefix cache (vLLM's cached_tokens, "
                               "llama-server's cache_n), by model.", ["model"], registry=r)
        self._wishes = Counter("llmgw_router_wakes", "Wakes asked: ModelWanted published for a parked model, by model.",
                               ["model"], registry=r)
        self._held = Counter("llmgw_router_held_requests",
                             "Requests held while their model woke, by model and outcome (served, timeout, "
                             "unplaceable, stopped, stopping).", ["model", "outcome"], registry=r)
        self._held_s = Histogram("llmgw_router_wake_wait_seconds",
                                 "How long a held request waited for its model to wake, by model.",
                                 ["model"], buckets=WAKE_BUCKETS, registry=r)
        # Each label set's children, looked up once: ``labels()`` takes a lock and builds a tuple every call.
        # Bounded as the labels are (known models, routes, status codes).
        self._answered: dict[tuple[str, str, int, bool], tuple[Any, Any]] = {}
        self._counted: dict[str, tuple[Any, Any, Any]] = {}
        self._first: dict[str, Any] = {}
        if pool is not None:
            r.register(_PoolCollector(pool, bad_events, idle_maps))
        if process:
            # What the default registry would show, in this one: CPU, memory, fds, GC, the Python version.
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)

    def observe(self, model: str, route: str, status: int, stream: bool, seconds: float) -> None:
        children = self._answered.get((model, route, status, stream))
        if children is None:
            children = self._answered[(model, route, status, stream)] = (
                self._requests.labels(model, route, str(status)), self._latency.labels(model, "true" if stream else "false"))
        children[0].inc()
        children[1].observe(seconds)

    def first_token(self, model: str, seconds: float) -> None:
        child = self._first.get(model)
        if child is None:
            child = self._first[model] = self._ttft.labels(model)
        child.observe(seconds)

    def tokens(self, model: str, usage: Usage) -> None:
        children = self._counted.get(model)
        if children is None:
            children = self._counted[model] = (self._prompt.labels(model), self._completion.labels(model),
                                               self._cached.labels(model))
        children[0].inc(usage.prompt_tokens)
        children[1].inc(usage.completion_tokens)
        children[2].inc(usage.cached_tokens)

    def wish(self, model: str) -> None:
        self._wishes.labels(model).inc()

    def held(self, model: str, outcome: str, seconds: float) -> None:
        self._held.labels(model, outcome).inc()
        self._held_s.labels(model).observe(seconds)

    def error(self, model: str, kind: str) -> None:
        self._errors.labels(model, kind).inc()

    def retry(self) -> None:
        self._retries.inc()

    # --- reading back (tests, logs) -------------------------------------------------

    def _value(self, name: str, **labels: str) -> int:
        return int(self.registry.get_sample_value(name, labels) or 0)

    @property
    def retries(self) -> int:
        return self._value("llmgw_router_retries_total")

    def errors(self, model: str, kind: str) -> int:
        return self._value("llmgw_router_errors_total", model=model, kind=kind)

    def requests(self, model: str, route: str, code: int) -> int:
        return self._value("llmgw_router_requests_total", model=model, route=route, code=str(code))

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The registry in the format ``accept`` asks for: (body, Content-Type)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type
