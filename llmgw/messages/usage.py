"""The usage stream (``llmgw.usage.<router>.*``): idle maps, wanted models, wake answers, adapters loaded."""

from __future__ import annotations

from typing import Annotated

import msgspec

from llmgw.messages.base import Event, Label, Name, Ref, Seconds, Seq, Time

# --- usage stream: llmgw.usage.<router>.idle ---------------------------------


class ModelLoad(msgspec.Struct, frozen=True, kw_only=True):
    """One model's demand at one router, at one tick."""

    in_flight: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    queued: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    replicas: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 0


_TokenCount = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]


class CacheUse(msgspec.Struct, frozen=True, array_like=True):
    """Prompt tokens a replica's engine reported over a router's tick, and how many it had cached."""

    model: Ref
    prompt_tokens: _TokenCount
    cached_tokens: _TokenCount


# The caller a router's map names for requests that came with no key (a router that asks for none):
# never a key's name (names begin with a letter or digit), so it is nobody's but theirs.
ANONYMOUS_CALLER = "-"


class KeyUse(msgspec.Struct, frozen=True, kw_only=True):
    """One API key's use of one model over a router's tick (what its engines' usage said)."""

    requests: _TokenCount = 0
    errors: _TokenCount = 0  # answered 4xx or 5xx
    throttled: _TokenCount = 0  # of the errors, answered 429 (its rate or quota, the model at capacity)
    forbidden: _TokenCount = 0  # of the errors, answered 403 (a model its key may not use)
    prompt_tokens: _TokenCount = 0
    completion_tokens: _TokenCount = 0
    cached_tokens: _TokenCount = 0
    ttft_s: Annotated[float, msgspec.Meta(ge=0, le=1e12)] = 0.0  # summed over its streamed requests
    latency_s: Annotated[float, msgspec.Meta(ge=0, le=1e12)] = 0.0  # summed over its requests


class IdleMapPublished(Event, tag="IdleMapPublished", frozen=True, kw_only=True):
    """One router's last request time per replica, once a tick.

    A replica the router has not served since it started is absent: unknown is
    not idle.
    """

    router: Name
    boot_id: Label
    tick: Seq
    # Replica ids as keys are plain strings: only looked up, never taken as a name, and bounded by
    # the message (NATS max_payload); a length check per key costs 40% of this stream's decoding.
    last_request: dict[str, Time] = {}
    # Replicas in this router's pool with no request since it started routing
    # to them, and since when: "nobody asked since X", never "idle forever".
    serving_since: dict[str, Time] = {}
    # Demand, for the scheduler's autoscaler: per model this router knows, requests
    # in flight to its replicas plus requests held while it wakes, and how many
    # healthy replicas it routes to; per replica, requests in flight (non-zero only),
    # so a scale-down never picks a replica in the middle of a request.
    load: dict[Ref, ModelLoad] = {}
    busy: dict[str, Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]] = {}
    tick_s: Seconds = 0.0  # the router's tick: how soon its load is stale
    # The last control-stream sequence the router had applied: a sample taken before a
    # model's replica count last changed says nothing about the new count.
    control_seq: Seq = 0
    # Per replica that answered with ``usage`` since this router's previous map (carried over when
    # a map is not published): its prompt tokens and the engine's cached share of them (issue 27).
    cache_use: Annotated[dict[Ref, CacheUse], msgspec.Meta(max_length=4096)] = {}
    # Per API key (ctl key) and model, what was asked through this router since its previous map.
    callers: Annotated[dict[Ref, Annotated[dict[Ref, KeyUse], msgspec.Meta(max_length=4096)]],
                       msgspec.Meta(max_length=100_000)] = {}


class MapCallers(Event, tag="IdleMapPublished", frozen=True, kw_only=True):
    """What a router's quotas read of an idle map: whose map, and who asked what (``callers``).

    The same bytes as ``IdleMapPublished``; the replicas' times, loads and cache use are passed
    over undecoded (a router starting reads a day of maps: their timestamps were most of it).
    """

    router: Name
    boot_id: Label
    callers: Annotated[dict[Ref, Annotated[dict[Ref, KeyUse], msgspec.Meta(max_length=4096)]],
                       msgspec.Meta(max_length=100_000)] = {}


class KeyDayTotals(Event, tag="KeyDayTotals", frozen=True, kw_only=True):
    """What one router's maps of ``day`` (UTC) said each key used, up to this message (``.day``).

    Published at a router's start, every few minutes and at its stop, so that a router starting
    reads each router's last totals and only the maps after them, not a whole day of maps. Only a
    router's own login may publish on its subject: no fold snapshot ever says what a key used.
    """

    router: Name
    boot_id: Label
    day: Annotated[str, msgspec.Meta(pattern=r"^\d{4}-\d{2}-\d{2}$", max_length=10)]
    tokens: Annotated[dict[Ref, _TokenCount], msgspec.Meta(max_length=100_000)] = {}


class ModelWanted(Event, tag="ModelWanted", frozen=True, kw_only=True):
    """A router holds requests for a declared model that has no healthy replica.

    ``control_seq`` is the last control-stream sequence the router had applied:
    the scheduler wakes idle stops at or before it, so the answer does not
    depend on how the usage and control streams interleave in a replay.
    """

    router: Name
    boot_id: Annotated[str, msgspec.Meta(max_length=64)]
    model: Ref
    control_seq: Seq
    waiting: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 1


class WakeAnswered(Event, tag="WakeAnswered", frozen=True, kw_only=True):
    """A router sent on the requests it held for a parked model, and the first of them was answered.

    The router's part of a cold start (the ledger, ``ctl model show``): ``held_since`` is when
    the first request was held (the model was wanted), ``released_at`` when a healthy replica
    let them go on, ``at`` when the first byte of an answer came back from ``replica_id``.
    Published on ``llmgw.usage.<router>.wanted`` with the router's next idle map.
    """

    router: Name
    boot_id: Annotated[str, msgspec.Meta(max_length=64)]
    model: Ref
    replica_id: Ref
    held_since: Time
    released_at: Time
    requests: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 1
    # Each released request's wait from being held to going on, seconds (the first 1,024).
    waits_s: Annotated[tuple[Seconds, ...], msgspec.Meta(max_length=1024)] = ()


class AdapterLoaded(Event, tag="AdapterLoaded", frozen=True, kw_only=True):
    """A router loaded an adapter into a replica's engine (vLLM's runtime load), or found it there."""

    router: Name
    replica_id: Ref
    adapter: Ref
    load_s: Annotated[float, msgspec.Meta(ge=0, le=86_400)] = 0.0  # how long the engine took (0: found loaded)


class AdapterUnloaded(Event, tag="AdapterUnloaded", frozen=True, kw_only=True):
    """A router unloaded an adapter from a replica: its least recently used, to make room for another."""

    router: Name
    replica_id: Ref
    adapter: Ref
    reason: Label = ""


UsageEvent = IdleMapPublished | ModelWanted | WakeAnswered | AdapterLoaded | AdapterUnloaded | KeyDayTotals


# --- not on the bus: the router's access log, one JSON line per request ---------

REQUEST_ID_MAX = 128
# What a client's x-request-id may hold to be kept: nothing a header, a JSON string or a shell would quote.
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:/+=@-]{1,128}\Z"
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=REQUEST_ID_MAX, pattern=REQUEST_ID_PATTERN)]
_Ms = Annotated[float, msgspec.Meta(ge=0, le=1e12)]


class AccessLine(msgspec.Struct, frozen=True, kw_only=True):
    """One request as a router's access log holds it (``--access-log``), and as ``ctl request ID`` reads it.

    ``caller`` names who asked, never a secret: a declared key's name, ``sha256:`` and the first 12
    hex digits of an ``--api-keys`` key's digest, or ``-`` (anonymous). Times are milliseconds from
    the request's arrival: ``queue_ms`` waiting for a slot at the model's capacity, ``wake_ms`` held
    while its model woke, ``ttft_ms`` to the engine's first byte (a stream's first chunk, else its
    answer's head), ``total_ms`` to the last byte written; ``-1`` where it never came to that.
    """

    at: Time  # when the request arrived
    id: RequestId
    router: Label = ""
    route: Label = ""
    caller: Label = ANONYMOUS_CALLER
    tenant: Label = ""
    model: Label = ""
    replica: Label = ""  # the last one tried; "" when none was
    status: Annotated[int, msgspec.Meta(ge=0, le=999)] = 0
    stream: bool = False
    error: Label = ""  # the error's code (``upstream_timeout``, ``rate_limit_exceeded``…), "" when it served
    prompt_tokens: _TokenCount = 0
    completion_tokens: _TokenCount = 0
    cached_tokens: _TokenCount = 0
    queue_ms: _Ms = 0.0
    wake_ms: _Ms = 0.0
    ttft_ms: Annotated[float, msgspec.Meta(ge=-1, le=1e12)] = -1.0
    total_ms: _Ms = 0.0
