"""The router: the OpenAI-compatible gateway in front of the replicas (``llmgw router``).

Where a request is routed:

* **Which replicas may take it**: ``llmgw/fleet/pool.py``, the pool every router folds
  from the control stream (``endpoints.EndpointSink`` keeps it): per model, the
  replicas whose latest state is healthy with an endpoint.
* **Whether it goes now**: ``gateway.Gateway`` admits it: its key, its quota
  (``quotas``), and at a model's declared capacity a slot, queued by its key's
  priority. A request for a parked model is held by ``wake.Wake`` until it serves.
* **Which replica takes it**: ``Gateway.acquire``: the fewest outstanding requests,
  ties rotated; for a model routed by prefix, ``prefix.pick`` chooses where the
  prompt's prefix is homed, within a load bound. The homes are kept per model in
  ``prefix.PrefixTable``, expired once a tick (``ticks``).

Where one request is found again: ``routes.Front``, the listener's one handler, gives it its id
(``access``: ``x-request-id``, sent on to the engine) and its access-log line (``--access-log``;
``ctl request ID`` reads it);
``spans`` makes its OpenTelemetry spans (``--otlp-endpoint``, the ``otel`` extra).
"""

from llmgw.router.endpoints import EndpointSink
from llmgw.router.metrics import usage_of_stream
from llmgw.router.server import DEFAULT_MAX_BODY, Router, serve_router

__all__ = ["DEFAULT_MAX_BODY", "EndpointSink", "Router", "serve_router", "usage_of_stream"]
