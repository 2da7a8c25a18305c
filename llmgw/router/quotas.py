"""Requests per minute and tokens per day per API key, across every router.

A router counts its own requests as it takes them and its tokens as the engines
report them, and adds what every other router's idle maps say (``callers``, read
from the usage stream as they are published). A router starting takes up the
newest fold snapshot's tokens of the day and every map after it, its own earlier
ones included, so a restart keeps every window. A request over a key's limit is
refused with 429: ``rate_limit_exceeded`` (requests per minute) or
``insufficient_quota`` (tokens per day, UTC), as OpenAI's own API names them,
with ``Retry-After``.

What a key asked of each model here since this router's last map (``KeyUseCounter``,
added to by each of its requests) is what that map's ``callers`` carry to the others.

The bound on overshoot: another router's traffic is known one of its ticks late
(10 s by default), so N routers may together let through at most one tick's worth
of each other's requests past a limit; and a request's tokens count once its
answer ends (a long stream's tokens, when it ends).
"""

from __future__ import annotations

import math
from collections import deque
from datetime import UTC, datetime, timedelta

from llmgw import messages as m
from llmgw.router.metrics import Usage

WINDOW_S = 60.0
BUCKET_S = 1.0  # requests are counted per second; the minute is the last 60 of them
TOKENS_MAX = 1 << 40  # the most a map carries for one key's model or one replica (KeyUse's and CacheUse's bound)


class KeyCounts:
    """One key's requests over the last minute (per second) and tokens today (UTC)."""

    __slots__ = ("buckets", "day", "tokens")

    def __init__(self) -> None:
        self.buckets: deque[list[float]] = deque()  # [second, requests], oldest first
        self.day = ""
        self.tokens = 0

    def add_requests(self, at: float, n: int) -> None:
        second = math.floor(at / BUCKET_S) * BUCKET_S
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
            self.buckets.popleft()
        total = int(sum(n for _, n in self.buckets))
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


def utc_day(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d")


def to_midnight(at: float) -> float:
    now = datetime.fromtimestamp(at, UTC)
    midnight = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return max((midnight - now).total_seconds(), 1.0)


class Quotas:
    """Every key's counts, this router's and the others' (fed from their maps)."""

    def __init__(self, router: str) -> None:
        self.router = router
        self.counts: dict[str, KeyCounts] = {}

    def _of(self, key: str) -> KeyCounts:
        c = self.counts.get(key)
        if c is None:
            c = self.counts[key] = KeyCounts()
        return c

    def refusal(self, key: m.KeyDeclared, now: float) -> tuple[str, str, float] | None:
        """(code, message, retry after s) when a request with ``key`` is over a limit, else None."""
        c = self.counts.get(key.name)
        if c is None:
            return None
        if key.requests_per_minute is not None:
            n, wait = c.requests(now)
            if n >= key.requests_per_minute:
                return ("rate_limit_exceeded", f"key {key.name} is over its {key.requests_per_minute} requests per "
                        f"minute across every router; retry after {math.ceil(wait)}s", wait)
        if key.tokens_per_day is not None and c.tokens_today(utc_day(now)) >= key.tokens_per_day:
            wait = to_midnight(now)
            return ("insufficient_quota", f"key {key.name} has used its {key.tokens_per_day} tokens for today (UTC) "
                    f"across every router; it renews at midnight UTC, in {math.ceil(wait)}s", wait)
        return None

    def took(self, key: str, now: float) -> None:
        """This router took a request with ``key``."""
        self._of(key).add_requests(now, 1)

    def used(self, key: str, tokens: int, now: float) -> None:
        """An answer to ``key`` ended with ``tokens`` (prompt + completion)."""
        self._of(key).add_tokens(utc_day(now), tokens)

    def other_map(self, event: m.IdleMapPublished) -> None:
        """A map of another router (or of this one before it restarted): what its keys asked counts here too."""
        if not event.callers:
            return
        at = event.at.timestamp()
        for key, per in event.callers.items():
            c = self._of(key)
            c.add_requests(at, sum(u.requests for u in per.values()))
            c.add_tokens(utc_day(at), sum(u.prompt_tokens + u.completion_tokens for u in per.values()))


class KeyUseCounter:
    """One key's use of one model since the router's last published map."""

    __slots__ = ("requests", "errors", "throttled", "forbidden", "prompt", "completion", "cached", "ttft_s",
                 "latency_s")

    def __init__(self) -> None:
        self.requests = self.errors = self.throttled = self.forbidden = self.prompt = self.completion = self.cached = 0
        self.ttft_s = self.latency_s = 0.0

    def add_request(self, status: int, seconds: float) -> None:
        self.requests += 1
        self.errors += status >= 400
        self.throttled += status == 429
        self.forbidden += status == 403
        self.latency_s += seconds

    def add_tokens(self, usage: Usage) -> None:
        self.prompt += usage.prompt_tokens
        self.completion += usage.completion_tokens
        self.cached += usage.cached_tokens

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


def key_use_of(key_use: dict[str, dict[str, KeyUseCounter]], key: str, model: str) -> KeyUseCounter:
    """``key``'s counter for ``model`` in ``key_use``, made by its first request since the last map."""
    per_model = key_use.setdefault(key, {})
    use = per_model.get(model)
    if use is None:
        use = per_model[model] = KeyUseCounter()
    return use
