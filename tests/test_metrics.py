"""The router's Prometheus histogram: every observation lands in exactly one bucket, never in the sum's slot."""

from __future__ import annotations

from llmgw.endpoints import Pool
from llmgw.metrics import LATENCY_BUCKETS, Metrics


def _samples(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_an_observation_above_the_largest_bucket_counts_only_in_inf_and_its_own_seconds_in_sum() -> None:
    metrics = Metrics()
    metrics.observe("m", "/v1/chat/completions", 200, False, 0.002)
    metrics.observe("m", "/v1/chat/completions", 200, False, LATENCY_BUCKETS[-1] + 180.0)  # a 5-minute request
    text = metrics.render(Pool(), 0, 0)
    labels = 'model="m",stream="false"'
    assert _samples(text, "llmgw_router_request_seconds_sum")[f"llmgw_router_request_seconds_sum{{{labels}}}"] == \
        round(0.002 + LATENCY_BUCKETS[-1] + 180.0, 6)
    buckets = _samples(text, "llmgw_router_request_seconds_bucket")
    assert buckets[f'llmgw_router_request_seconds_bucket{{{labels},le="{LATENCY_BUCKETS[-1]}"}}'] == 1
    assert buckets[f'llmgw_router_request_seconds_bucket{{{labels},le="+Inf"}}'] == 2
    assert _samples(text, "llmgw_router_request_seconds_count")[f"llmgw_router_request_seconds_count{{{labels}}}"] == 2
