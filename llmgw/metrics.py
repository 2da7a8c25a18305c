"""The router's Prometheus metrics, in the text format, written by hand."""

from __future__ import annotations

import bisect

from llmgw.endpoints import Pool

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """Counters and histograms in Prometheus text format, written by hand."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, int], int] = {}
        self.errors: dict[tuple[str, str], int] = {}
        self.latency: dict[tuple[str, bool], list[float]] = {}  # bucket counts..., sum, count
        self.retries = 0

    def observe(self, model: str, route: str, status: int, stream: bool, seconds: float) -> None:
        key = (model, route, status)
        self.requests[key] = self.requests.get(key, 0) + 1
        hist = self.latency.get((model, stream))
        if hist is None:
            hist = self.latency[(model, stream)] = [0.0] * (len(LATENCY_BUCKETS) + 3)  # buckets, above the last, sum, count
        hist[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        hist[-2] += seconds
        hist[-1] += 1

    def error(self, model: str, kind: str) -> None:
        key = (model, kind)
        self.errors[key] = self.errors.get(key, 0) + 1

    def render(self, pool: Pool, bad_events: int, idle_maps: int) -> str:
        out: list[str] = []
        out.append("# HELP llmgw_router_requests_total Requests answered, by model, route and status.")
        out.append("# TYPE llmgw_router_requests_total counter")
        for (model, route, status), n in sorted(self.requests.items()):
            out.append(f'llmgw_router_requests_total{{model="{_label(model)}",route="{route}",code="{status}"}} {n}')
        out.append("# HELP llmgw_router_errors_total Requests that failed, by model and kind.")
        out.append("# TYPE llmgw_router_errors_total counter")
        for (model, kind), n in sorted(self.errors.items()):
            out.append(f'llmgw_router_errors_total{{model="{_label(model)}",kind="{kind}"}} {n}')
        out.append("# HELP llmgw_router_retries_total Requests retried on another replica after a connection failure.")
        out.append("# TYPE llmgw_router_retries_total counter")
        out.append(f"llmgw_router_retries_total {self.retries}")
        out.append("# HELP llmgw_router_request_seconds Time from request to the last byte, by model and stream.")
        out.append("# TYPE llmgw_router_request_seconds histogram")
        for (model, stream), hist in sorted(self.latency.items()):
            labels = f'model="{_label(model)}",stream="{str(stream).lower()}"'
            acc = 0
            for bound, count in zip(LATENCY_BUCKETS, hist, strict=False):
                acc += int(count)
                out.append(f'llmgw_router_request_seconds_bucket{{{labels},le="{bound}"}} {acc}')
            out.append(f'llmgw_router_request_seconds_bucket{{{labels},le="+Inf"}} {int(hist[-1])}')
            out.append(f"llmgw_router_request_seconds_sum{{{labels}}} {hist[-2]:.6f}")
            out.append(f"llmgw_router_request_seconds_count{{{labels}}} {int(hist[-1])}")
        out.append("# HELP llmgw_router_in_flight Requests in flight per replica.")
        out.append("# TYPE llmgw_router_in_flight gauge")
        per_model: dict[str, int] = {}
        for r in sorted(pool.replicas.values(), key=lambda r: r.replica_id):
            out.append(f'llmgw_router_in_flight{{replica="{_label(r.replica_id)}",model="{_label(r.model)}"}} {r.outstanding}')
            per_model[r.model] = per_model.get(r.model, 0) + r.outstanding
        out.append("# HELP llmgw_router_model_in_flight Requests in flight per model.")
        out.append("# TYPE llmgw_router_model_in_flight gauge")
        for model, n in sorted(per_model.items()):
            out.append(f'llmgw_router_model_in_flight{{model="{_label(model)}"}} {n}')
        out.append("# HELP llmgw_router_replicas Replicas this router knows, by state.")
        out.append("# TYPE llmgw_router_replicas gauge")
        for state, n in sorted(pool.states().items()):
            out.append(f'llmgw_router_replicas{{state="{state}"}} {n}')
        out.append("# HELP llmgw_router_bad_events_total Control events skipped: undecodable, or refused (a node speaking for another).")
        out.append("# TYPE llmgw_router_bad_events_total counter")
        out.append(f"llmgw_router_bad_events_total {bad_events}")
        out.append("# HELP llmgw_router_idle_maps_total Idle maps published.")
        out.append("# TYPE llmgw_router_idle_maps_total counter")
        out.append(f"llmgw_router_idle_maps_total {idle_maps}")
        return "\n".join(out) + "\n"
