"""Requests per minute and tokens per day per API key, across every router.

A router counts its own requests as it takes them and its tokens as the engines
report them, and adds what every other router's idle maps say (``callers``, read
from the usage stream as they are published). A router starting counts each router's
last day totals and the maps after them (``llmgw/router/days.py``), its own earlier
boots' included, and what its journal holds past its last stored map
(``llmgw/router/journal.py``), before it answers, so neither a restart nor a crash
opens a window, and no fold snapshot says what a key used. A
request over a key's limit is refused with 429: ``rate_limit_exceeded`` (requests per
minute, or a day's tokens all reserved by requests in flight) or ``insufficient_quota``
(tokens per day, UTC), as OpenAI's own API names them, with ``Retry-After``.

Tokens are reserved when a request is taken (``reserve``): its prompt estimated from its
body (a token per ``BYTES_PER_TOKEN`` bytes) plus its ``max_tokens`` (times ``n``), or
``DEFAULT_COMPLETION_TOKENS`` when it names none; a key is taken while what it used
today plus what its requests in flight reserved is under its limit. At the end the
reservation is given back and the engine's count kept (``settle``); an answer served
without a count (a stream cut short) is charged its reservation.

What a key asked of each model here since this router's last map (``KeyUseCounter``,
added to by each of its requests) is what that map's ``callers`` carry to the others.

The bound on overshoot, per router: a key is over its day by at most the reservation
of the last request taken (its ``max_tokens`` and prompt, when its prompt is no longer
in tokens than estimated and, without ``max_tokens``, its answer no longer than the
default), however many are sent in parallel. Across N routers, another router's traffic
is known one of its ticks late (10 s by default), so N routers may together let through
up to N times that within one tick; and requests per minute likewise.
"""

from __future__ import annotations

import functools
import math
import time
from collections import deque
from datetime import UTC, datetime, timedelta

from llmgw import messages as m
from llmgw.router.journal import Counted, Journal
from llmgw.router.metrics import Usage

WINDOW_S = 60.0
BUCKET_S = 1.0  # requests are counted per second; the minute is the last 60 of them
TOKENS_MAX = 1 << 40  # the most a map carries for one key's model or one replica (KeyUse's and CacheUse's bound)
BYTES_PER_TOKEN = 4  # a prompt's estimate: a token per 4 bytes of its body (English runs 4-5 characters a token)
DEFAULT_COMPLETION_TOKENS = 1024  # reserved for a request that names no max_tokens (engines default to its context)
IN_FLIGHT_RETRY_S = 1.0  # a day's tokens reserved by requests in flight: they end soon, retry then


class Reservation:
    """The tokens one request holds of its key's day until it ends, and whether the engine counted it."""

    __slots__ = ("key", "model", "prompt", "completion", "served", "counted")

    def __init__(self, key: str, model: str, prompt: int, completion: int) -> None:
        self.key, self.model, self.prompt, self.completion = key, model, prompt, completion
        self.served = False  # the engine began an answer (200)
        self.counted = False  # and said what it used

    @property
    def tokens(self) -> int:
        return self.prompt + self.completion


def estimate(body_bytes: int, completion_cap: int | None, embeddings: bool = False) -> tuple[int, int]:
    """(prompt, completion) tokens a request may use, before it runs."""
    prompt = min(body_bytes // BYTES_PER_TOKEN + 1, TOKENS_MAX)
    if embeddings:
        return prompt, 0
    return prompt, min(completion_cap if completion_cap is not None else DEFAULT_COMPLETION_TOKENS, TOKENS_MAX)


class KeyCounts:
    """One key's requests over the last minute (per second) and tokens today (UTC)."""

    __slots__ = ("buckets", "day", "tokens", "total")

    def __init__(self) -> None:
        self.buckets: deque[list[float]] = deque()  # [second, requests], oldest first
        self.total = 0.0  # what the buckets hold, kept as they change: not summed per request
        self.day = ""
        self.tokens = 0

    def add_requests(self, at: float, n: int) -> None:
        second = math.floor(at / BUCKET_S) * BUCKET_S
        self.total += n
        if self.buckets and self.buckets[-1][0] == second:
            self.buckets[-1][1] += n
        elif not self.buckets or second > self.buckets[-1][0]:
            self.buckets.append([second, n])
        else:  # an older map read late: into its own second, in order
            for b in self.buckets:
                if b[0] == second:
                    b[1] += n
                    break
            else:
                self.buckets.append([second, n])
                self.buckets = deque(sorted(self.buckets))

    def requests(self, now: float) -> tuple[int, float]:
        """Requests in the last minute, and seconds until the oldest of them leaves it."""
        while self.buckets and self.buckets[0][0] <= now - WINDOW_S:
            self.total -= self.buckets.popleft()[1]
        total = int(self.total)
        wait = self.buckets[0][0] + WINDOW_S - now if self.buckets else 0.0
        return total, max(wait, 1.0)

    def add_tokens(self, day: str, n: int) -> None:
        if day != self.day:
            if day < self.day:
                return  # yesterday's, read late: not today's quota
            self.day, self.tokens = day, 0
        self.tokens += n

    def tokens_today(self, day: str) -> int:
        return self.tokens if day == self.day else 0


_DAY_S = 86_400


@functools.lru_cache(maxsize=4)
def _day_name(day: int) -> str:
    return datetime.fromtimestamp(day * _DAY_S, UTC).strftime("%Y-%m-%d")


def utc_day(at: float) -> str:
    """``at``'s UTC date (``2026-12-03``), formatted once a day rather than per request (Unix days are 86,400 s)."""
    return _day_name(int(at // _DAY_S))


def to_midnight(at: float) -> float:
    now = datetime.fromtimestamp(at, UTC)
    midnight = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return max((midnight - now).total_seconds(), 1.0)


class Quotas:
    """Every key's counts, this router's and the others' (fed from their maps)."""

    def __init__(self, router: str) -> None:
        self.router = router
        self.counts: dict[str, KeyCounts] = {}
        self.reserved: dict[str, int] = {}  # per key, the tokens its requests in flight here hold

    def _of(self, key: str) -> KeyCounts:
        c = self.counts.get(key)
        if c is None:
            c = self.counts[key] = KeyCounts()
        return c

    def refusal(self, key: m.KeyDeclared, now: float) -> tuple[str, str, float] | None:
        """(code, message, retry after s) when a request with ``key`` is over a limit, else None."""
        c = self.counts.get(key.name)
        if c is None:
            c = KeyCounts()
        if key.requests_per_minute is not None:
            n, wait = c.requests(now)
            if n >= key.requests_per_minute:
                return ("rate_limit_exceeded", f"key {key.name} is over its {key.requests_per_minute} requests per "
                        f"minute across every router; retry after {math.ceil(wait)}s", wait)
        if key.tokens_per_day is not None:
            used, held = c.tokens_today(utc_day(now)), self.reserved.get(key.name, 0)
            if used >= key.tokens_per_day:
                wait = to_midnight(now)
                return ("insufficient_quota", f"key {key.name} has used its {key.tokens_per_day} tokens for today "
                        f"(UTC) across every router; it renews at midnight UTC, in {math.ceil(wait)}s", wait)
            if used + held >= key.tokens_per_day:
                return ("rate_limit_exceeded", f"key {key.name} has {used} of its {key.tokens_per_day} tokens for "
                        f"today used and {held} reserved by its requests in flight here; retry after "
                        f"{math.ceil(IN_FLIGHT_RETRY_S)}s, when they have ended", IN_FLIGHT_RETRY_S)
        return None

    def reserve(self, key: str, model: str, prompt: int, completion: int) -> Reservation:
        """A request taken with ``key`` holds what it may use until it is ``settle``d."""
        hold = Reservation(key, model, prompt, completion)
        self.reserved[key] = self.reserved.get(key, 0) + hold.tokens
        return hold

    def settle(self, hold: Reservation) -> None:
        """The request ended: its reservation is given back (what it used was counted by ``used``)."""
        left = self.reserved.get(hold.key, 0) - hold.tokens
        if left > 0:
            self.reserved[hold.key] = left
        else:
            self.reserved.pop(hold.key, None)

    def took(self, key: str, now: float) -> None:
        """This router took a request with ``key``."""
        self._of(key).add_requests(now, 1)

    def used(self, key: str, tokens: int, now: float) -> None:
        """An answer to ``key`` ended with ``tokens`` (prompt + completion)."""
        self._of(key).add_tokens(utc_day(now), tokens)

    def other_map(self, event: m.IdleMapPublished | m.MapCallers, *, tokens: bool = True) -> None:
        """A map of another router (or of this one before it restarted): what its keys asked counts here too.

        ``tokens=False``: its requests only (a map a router's day totals already hold, read for the minute).
        """
        if not event.callers:
            return
        at = event.at.timestamp()
        day, recent = utc_day(at), at > time.time() - WINDOW_S  # a map of hours ago fills no minute
        counts = self.counts
        for key, per in event.callers.items():
            c = counts.get(key) or self._of(key)
            requests = used = 0
            for u in per.values():
                requests += u.requests
                used += u.prompt_tokens + u.completion_tokens
            if recent:
                c.add_requests(at, requests)
            if tokens:
                c.add_tokens(day, used)

    def counted(self, key: str, at: float, requests: int, tokens: int) -> None:
        """What a map (or the journal, for a map a crash kept from the bus) says ``key`` asked at ``at``."""
        c = self._of(key)
        if requests and at > time.time() - WINDOW_S:  # hours ago fills no minute
            c.add_requests(at, requests)
        c.add_tokens(utc_day(at), tokens)


class KeyUseCounter:
    """One key's use of one model since the router's last published map."""

    __slots__ = ("requests", "errors", "throttled", "forbidden", "prompt", "completion", "cached", "ttft_s",
                 "latency_s", "journal", "key", "model")

    def __init__(self, journal: Journal | None = None, key: str = "", model: str = "") -> None:
        self.requests = self.errors = self.throttled = self.forbidden = self.prompt = self.completion = self.cached = 0
        self.ttft_s = self.latency_s = 0.0
        self.journal, self.key, self.model = journal, key, model  # each count a line, before the map carries it

    def add_request(self, status: int, seconds: float) -> None:
        self.requests += 1
        self.errors += status >= 400
        self.throttled += status == 429
        self.forbidden += status == 403
        self.latency_s += seconds
        if self.journal is not None:
            self.journal.write(Counted(time.time(), self.key, self.model, requests=1, errors=int(status >= 400),
                                       throttled=int(status == 429), forbidden=int(status == 403), latency_s=seconds))

    def add_tokens(self, usage: Usage) -> None:
        self.prompt += usage.prompt_tokens
        self.completion += usage.completion_tokens
        self.cached += usage.cached_tokens
        if self.journal is not None:
            self.journal.write(Counted(time.time(), self.key, self.model, prompt=usage.prompt_tokens,
                                       completion=usage.completion_tokens, cached=usage.cached_tokens))

    def add_ttft(self, seconds: float) -> None:
        self.ttft_s += seconds
        if self.journal is not None:
            self.journal.write(Counted(time.time(), self.key, self.model, ttft_s=seconds))

    def merge(self, c: Counted) -> None:
        """A count the journal kept from a map a crash lost: carried by the next map (not journaled again)."""
        self.requests += c.requests
        self.errors += c.errors
        self.throttled += c.throttled
        self.forbidden += c.forbidden
        self.prompt += c.prompt
        self.completion += c.completion
        self.cached += c.cached
        self.ttft_s += c.ttft_s
        self.latency_s += c.latency_s

    def message(self) -> m.KeyUse:
        cap = TOKENS_MAX
        return m.KeyUse(requests=min(self.requests, cap), errors=min(self.errors, cap),
                        throttled=min(self.throttled, cap), forbidden=min(self.forbidden, cap),
                        prompt_tokens=min(self.prompt, cap),
                        completion_tokens=min(self.completion, cap), cached_tokens=min(self.cached, cap),
                        ttft_s=min(self.ttft_s, 1e12), latency_s=min(self.latency_s, 1e12))

    def take(self, sent: m.KeyUse) -> bool:
        """Take off what a published map carried; True when nothing is left."""
        self.requests -= sent.requests
        self.errors -= sent.errors
        self.throttled -= sent.throttled
        self.forbidden -= sent.forbidden
        self.prompt -= sent.prompt_tokens
        self.completion -= sent.completion_tokens
        self.cached -= sent.cached_tokens
        self.ttft_s -= sent.ttft_s
        self.latency_s -= sent.latency_s
        return self.requests <= 0 and self.prompt <= 0 and self.completion <= 0


class KeyUseTable(dict[str, dict[str, KeyUseCounter]]):
    """Per key and model, what was asked since the last published map; with the journal its counters write to."""

    journal: Journal | None = None


def key_use_of(key_use: dict[str, dict[str, KeyUseCounter]], key: str, model: str) -> KeyUseCounter:
    """``key``'s counter for ``model`` in ``key_use``, made by its first request since the last map."""
    per_model = key_use.setdefault(key, {})
    use = per_model.get(model)
    if use is None:
        journal = key_use.journal if isinstance(key_use, KeyUseTable) else None
        use = per_model[model] = KeyUseCounter(journal, key, model)
    return use
