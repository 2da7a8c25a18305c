"""A key's day across router restarts: each router's day totals, and what a router starting reads.

Reading every map stored since midnight made a router's start grow with the day and with its
keys: 25,920 maps of 50 keys (three routers on a 10 s tick, late in the day) took ~20 s on two
busy cores. So each router also publishes what its own maps of the day said each key used
(``KeyDayTotals`` on ``llmgw.usage.<router>.day``): at its start, every ``TOTALS_EVERY_S`` and at
its stop. A router starting reads every router's last totals (one ``last_per_subject`` read),
then per router only the maps stored after them, and every map of the last minute for the
requests-per-minute windows (``take_up_day``). Nothing here comes from a fold snapshot: only a
router's own login may publish on its subjects, so no projector can give a key its day back.

The totals a router publishes are exactly the sum of its name's published maps of the day up to
that message (its earlier boots' read back at start), so "totals, then the maps after them"
counts every map once. A router of an earlier version publishes no totals: of its maps, those
of the last minute count (its tokens and requests), its earlier ones of the day do not.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.router.quotas import WINDOW_S, Quotas, utc_day

log = logging.getLogger(__name__)

TOTALS_EVERY_S = 300.0  # how often a router says its day so far: a start reads at most this much of its maps


class OwnDay:
    """What this router's name has published of ``day`` per key: its maps' tokens, its earlier boots' too."""

    __slots__ = ("day", "tokens", "known", "sent_at")

    def __init__(self) -> None:
        self.day = ""
        self.tokens: dict[str, int] = {}
        self.known = False  # its earlier boots' part is read (take_up_day): only then are totals true
        self.sent_at = 0.0  # monotonic time of the last totals published

    def add(self, day: str, callers: dict[str, dict[str, m.KeyUse]]) -> None:
        """A map of this router's name (published by this boot, or read back from an earlier one)."""
        if day < self.day:
            return  # yesterday's, read late
        if day > self.day:
            self.day, self.tokens = day, {}
        for key, per in callers.items():
            self.tokens[key] = self.tokens.get(key, 0) + sum(u.prompt_tokens + u.completion_tokens
                                                             for u in per.values())

    def totals(self, router: str, boot_id: str, now: float) -> m.KeyDayTotals:
        today = utc_day(now)
        return m.KeyDayTotals(at=m.utcnow(), router=router, boot_id=boot_id, day=today,
                              tokens=self.tokens if self.day == today else {})


async def _maps(bus: Bus, who: str, subject: str, start: int, end: int) -> list[tuple[int, m.MapCallers]]:
    """The idle maps on ``subject`` (one router's, or every router's) stored from ``start`` through ``end``."""
    if start > end:
        return []
    follower = bus.follow(subjects.STREAM_USAGE, m.MAP_CALLERS_DECODER, start, stop_at=end, who=who,
                          filter_subjects=(subject,))
    out: list[tuple[int, m.MapCallers]] = []
    async for batch in follower.batches():
        out += [(d.raw.seq, d.event) for d in batch if isinstance(d.event, m.MapCallers)]
        if follower.drained or follower.last_seq >= end:
            break
    return out


async def take_up_day(bus: Bus, name: str, boot_id: str, quotas: Quotas, own: OwnDay) -> int:
    """Count what every key used today and in the last minute, through any router; returns the last usage
    sequence read (a live follow goes on after it). ``own`` learns this router's name's day so far."""
    who = f"router {name}"
    last: dict[str, tuple[int, m.KeyDayTotals]] = {}
    for seq, subject, data in await bus.last_per_subject(subjects.STREAM_USAGE, subjects.USAGE_DAY_ALL):
        try:
            event = m.USAGE_DECODER.decode(data)
        except m.DECODE_ERRORS as e:
            log.warning("%s: %s seq %d (%s) unreadable, skipped: %s", who, subjects.STREAM_USAGE, seq, subject, e)
            continue
        why = subjects.disagrees(subject, event)
        if not isinstance(event, m.KeyDayTotals) or why is not None:
            log.warning("%s: %s seq %d (%s) refused, skipped: %s", who, subjects.STREAM_USAGE, seq, subject,
                        why or f"a {type(event).__name__} is no day's totals")
            continue
        last[event.router] = (seq, event)
    end = await bus.stream_last_seq(subjects.STREAM_USAGE)  # after the totals: each is at or before it
    now = time.time()
    today = utc_day(now)
    minute = await bus.seq_at_time(subjects.STREAM_USAGE, datetime.fromtimestamp(now - WINDOW_S, UTC))
    # Every read first, then the counts: a read that fails leaves the quotas as they were for the retry.
    maps: list[tuple[m.MapCallers, bool]] = []  # (map, whether its tokens count: no totals hold them)
    for router, (seq, _) in last.items():
        # Its maps after its totals, whole; and those of the last minute before them, for the minute.
        maps += [(seen, map_seq > seq)
                 for map_seq, seen in await _maps(bus, who, subjects.usage_idle(router), min(seq + 1, minute), end)
                 if seen.router == router and seen.boot_id != boot_id]
    # Routers that never said their day (an earlier version): their last minute.
    maps += [(seen, True) for _, seen in await _maps(bus, who, subjects.USAGE_IDLE_ALL, minute, end)
             if seen.router not in last and seen.boot_id != boot_id]
    for router, (_, totals) in last.items():
        if totals.day == today:
            for key, tokens in totals.tokens.items():
                quotas.used(key, tokens, now)  # today's, as an answer's tokens are
            if router == name:
                own.day, own.tokens = today, dict(totals.tokens)
    for seen, whole in maps:
        quotas.other_map(seen, tokens=whole)
        if whole and seen.router == name:
            own.add(utc_day(seen.at.timestamp()), seen.callers)
    own.known = True
    return end
