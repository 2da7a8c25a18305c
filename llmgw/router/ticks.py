"""Once per tick: the idle map, what each key and each replica's cache used since the last one, the recall at start.

* Once a tick the router publishes one ``IdleMapPublished``; a replica with no
  request since this router started is absent from ``last_request``: unknown is not
  idle. Requests leave what the map needs where it costs them nothing (a timestamp
  in ``IdleTracker``, sums in ``key_use`` and ``cache_use``); a published map takes
  off what it carried, and one not published leaves it for the next (maps are
  cumulative).
* With the map go the wakes answered since the last one and, while a model stays
  parked, its wish again (``wake.Wake``); prefixes nobody sent lately expire.
* At start the router takes up its own last map from before it (re)started (the idle
  recall) and every key's day so far (``llmgw/router/days.py``: each router's day
  totals and the maps after them), and then follows every router's maps on the usage
  stream: what a key asked anywhere counts here too. Its own day totals go out at its
  start, every ``TOTALS_EVERY_S`` after a map, and at its stop.
* With a journal (``llmgw/router/journal.py``), each map marks where it cut it and a
  stored one cuts it there; at start what no stored map carries is taken up
  (``take_up_journal``), so a router killed mid-tick loses none of that tick's counts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.errors import LlmgwError
from llmgw.router import journal as journaling
from llmgw.router import prefix as prefixroute
from llmgw.router.days import TOTALS_EVERY_S, OwnDay, take_up_day
from llmgw.router.endpoints import EndpointSink, Pool
from llmgw.router.idle import IdleTracker
from llmgw.router.journal import Journal
from llmgw.router.quotas import TOKENS_MAX, KeyUseTable, Quotas, key_use_of, utc_day
from llmgw.router.wake import Wake

log = logging.getLogger(__name__)
_UNREAD: tuple[type[Exception], ...] = (LlmgwError, *m.DECODE_ERRORS)  # a last map not read, or not readable

class Ticks:
    """The ticker and what it publishes; the usage stream followed for the keys' quotas."""

    def __init__(self, *, bus: Bus, name: str, boot_id: str, pool: Pool, sink: EndpointSink, quotas: Quotas,
                 idle: IdleTracker, prefixes: dict[str, prefixroute.PrefixTable], wake: Wake, tick_s: float,
                 journal: Journal | None = None) -> None:
        self.bus = bus
        self.name = name
        self.boot_id = boot_id
        self.pool = pool
        self.sink = sink
        self.quotas = quotas
        self.idle = idle
        self.prefixes = prefixes
        self.wake = wake
        self.tick_s = tick_s
        self.idle_maps = 0
        # Per key and model, what was asked since the last published map (ctl key; usage_by_key in DuckDB).
        self.key_use = KeyUseTable()
        self.journal = self.key_use.journal = journal  # … each count also a line there, until a stored map carries it
        # Per replica answered since the last published map: [model, prompt tokens, cached tokens].
        self.cache_use: dict[str, list[Any]] = {}
        # This router's last idle map from before this boot, read once for the idle recall.
        self._before: tuple[int, bytes] | None = None
        self._before_read = False
        self._before_lock = asyncio.Lock()
        self.usage_caught_up = asyncio.Event()  # the day's use stored at start is counted
        self.own_day = OwnDay()  # what this router's name published of today, for its day totals
        self._publishing = asyncio.Lock()  # a map, what it took off and the totals after it: in that order
        self._usage_seq = 0  # the next usage stream sequence to read; 0: not started (where to start is found first)

    async def run(self) -> None:
        """Publish a map every ``tick_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await self.publish_idle_map()
            except LlmgwError as e:
                # The next map carries everything this one would have: maps are cumulative.
                log.warning("router %s: idle map not published: %s", self.name, e)
                if self.journal is not None:
                    self.journal.compact()  # nothing cuts it while no map is stored

    async def publish_idle_map(self) -> m.IdleMapPublished:
        """Publish this tick's idle map now (and a wish for each model still waiting); return the map."""
        async with self._publishing:
            event = self._idle_map()
            await self.bus.publish(event, timeout=max(1.0, self.tick_s))
            self._published(event)
            if not self.own_day.sent_at or time.monotonic() - self.own_day.sent_at >= TOTALS_EVERY_S:
                await self._publish_totals(max(1.0, self.tick_s))
        now = time.monotonic()
        for table in self.prefixes.values():
            table.expire(now)  # prefixes nobody sent for prefixroute.WINDOW_S
        for answered in self.wake.ledger.drain(self.name, self.boot_id):
            await self.bus.publish(answered, timeout=max(1.0, self.tick_s))
        self.wake.wish_parked()
        return event

    async def publish_last(self) -> None:
        """The map a stopping router leaves: the requests since the last tick, and the wakes answered since."""
        async with self._publishing:
            event = self._idle_map()
            await self.bus.publish(event, timeout=2.0)
            self._published(event)
            await self._publish_totals(2.0)
        for answered in self.wake.ledger.drain(self.name, self.boot_id):  # the ledger's router part too
            await self.bus.publish(answered, timeout=2.0)

    def _idle_map(self) -> m.IdleMapPublished:
        """This tick's map, with the prompt tokens each replica's engine reported since the last one."""
        event = self.idle.idle_map(self.name, self.boot_id, self.pool, m.utcnow(), self.wake.queued(), self.tick_s,
                                   self.sink.applied_seq)
        changes: dict[str, Any] = {}
        if self.cache_use:
            changes["cache_use"] = {rid: m.CacheUse(model, min(p, TOKENS_MAX), min(c, p, TOKENS_MAX))
                                    for rid, (model, p, c) in sorted(self.cache_use.items())}
        if self.key_use:
            changes["callers"] = {key: {model: use.message() for model, use in sorted(per.items())}
                                  for key, per in sorted(self.key_use.items())}
        if self.journal is not None:
            self.journal.mapped(self.boot_id, event.tick)
        return msgspec.structs.replace(event, **changes) if changes else event

    async def _publish_totals(self, timeout: float) -> None:  # noqa: ASYNC109 - the bus's publish timeout
        """This router's day so far (``KeyDayTotals``), once its earlier boots' part is known; none while it
        has nothing to say and has said nothing (a router no key has used needs no totals)."""
        if not self.own_day.known or (not self.own_day.tokens and not self.own_day.sent_at):
            return
        try:
            await self.bus.publish(self.own_day.totals(self.name, self.boot_id, time.time()), timeout=timeout)
        except LlmgwError as e:  # nothing is lost: a start reads the maps after the last totals stored
            log.warning("router %s: day totals not published (%s); after the next map again", self.name, e)
            return
        self.own_day.sent_at = time.monotonic()

    def _published(self, event: m.IdleMapPublished) -> None:
        """What a published map carried is taken off; a map not published leaves it for the next."""
        self.idle_maps += 1
        if event.callers:
            self.own_day.add(utc_day(event.at.timestamp()), event.callers)
        if self.journal is not None:
            self.journal.published(event.tick)
        for key, per in event.callers.items():
            for model, sent in per.items():
                counter = self.key_use.get(key, {}).get(model)
                if counter is not None and counter.take(sent):
                    del self.key_use[key][model]
            if not self.key_use.get(key):
                self.key_use.pop(key, None)
        for rid, use in event.cache_use.items():
            left = self.cache_use.get(rid)
            if left is not None:
                left[1] -= use.prompt_tokens
                left[2] -= use.cached_tokens
                if left[1] <= 0 or rid not in self.pool.replicas:
                    del self.cache_use[rid]

    # --- at start ---------------------------------------------------------------

    async def recall(self) -> None:
        """Take up this router's last idle map from before it (re)started, so idle time survives a restart.

        A restarted router knew no request, so every replica looked served-since-now ("idle 5s")
        however long nobody had asked. Its own last map says when each replica was last asked
        and since when it served those never asked; a replica it had not seen stays unknown.
        """
        try:
            got = await self._last_map_before()
        except LlmgwError as e:
            log.warning("router %s: its last idle map could not be read (%s); idle times start from now", self.name, e)
            return
        if got is None:
            return
        try:
            event = m.USAGE_DECODER.decode(got[1])
        except m.DECODE_ERRORS as e:
            log.warning("router %s: its last idle map is unreadable (%s); idle times start from now", self.name, e)
            return
        if not isinstance(event, m.IdleMapPublished) or event.router != self.name:
            return
        now = time.time()
        for rid, at in event.last_request.items():
            if rid in self.pool.replicas and rid not in self.idle.last:
                self.idle.last[rid] = min(at.timestamp(), now)
        for rid, at in event.serving_since.items():
            rep = self.pool.replicas.get(rid)
            if rep is not None and rep.in_pool and rid not in self.idle.last:
                rep.pooled_at = min(rep.pooled_at, at.timestamp())
        log.info("router %s: took up its last map (tick %d): %d requests, %d served since", self.name, event.tick,
                 len(event.last_request), len(event.serving_since))

    async def take_up_journal(self) -> int:
        """What this router counted before it (re)started that no stored map carries: into its quotas, and
        into its next map (so the others count it too); the journal is then appended to. Returns how many.

        Read before this boot's first map is built, so that map carries them and cuts them off.
        """
        if self.journal is None:
            return 0
        entries = self.journal.read()
        try:
            got = await self._last_map_before()
            last = m.USAGE_DECODER.decode(got[1]) if got is not None else None
        except _UNREAD as e:
            # Unknown which map the bus stored last: the journal's first marker is the last one it is known to.
            log.warning("router %s: its last idle map could not be read (%s); the journal is taken up from its "
                        "first mark", self.name, e)
            mark = next((x for x in entries if isinstance(x, journaling.Mapped)), None)
            left = journaling.uncovered(entries, mark.boot_id if mark else None, mark.tick if mark else 0, 0.0)
        else:
            if isinstance(last, m.IdleMapPublished) and last.router == self.name:
                left = journaling.uncovered(entries, last.boot_id, last.tick, last.at.timestamp())
                mark = journaling.Mapped(last.boot_id, last.tick)
            else:  # the bus holds no map of this router: nothing it counted was carried
                left, mark = journaling.uncovered(entries, None, 0, 0.0), None
        # From now on the journal holds the last stored map's marker and what it did not carry, nothing older.
        self.journal.open([*([mark] if mark is not None else []), *left])
        for c in left:
            key_use_of(self.key_use, c.key, c.model).merge(c)
            self.quotas.counted(c.key, c.at, c.requests, c.prompt + c.completion)
        if left:
            log.info("router %s: took up %d counts from its journal that no stored map carried", self.name, len(left))
        return len(left)

    async def _last_map_before(self) -> tuple[int, bytes] | None:
        """This router's own last idle map as it was before this boot published any (one direct get, kept;
        a failed read is not kept, so the caller's retry reads again)."""
        async with self._before_lock:
            if not self._before_read:
                self._before = await self.bus.last_message(subjects.STREAM_USAGE, subjects.usage_idle(self.name))
                self._before_read = True
            return self._before

    async def follow_usage(self) -> None:
        """The routers' maps, as they are published: what each key asked anywhere counts here too.

        Reads until the bus fails; called again, it goes on after the last map it read.
        ``usage_caught_up`` is set once the maps stored when it started are read.
        """
        if not self._usage_seq:
            # Every key's day and minute, through any router; never a fold snapshot's key_usage, which
            # nothing vouches for (security round 4). Then this router's day with its earlier boots' part.
            self._usage_seq = await take_up_day(self.bus, self.name, self.boot_id, self.quotas, self.own_day) + 1
            async with self._publishing:
                await self._publish_totals(max(1.0, self.tick_s))
        follower = self.bus.follow(subjects.STREAM_USAGE, m.MAP_CALLERS_DECODER, self._usage_seq,
                                   who=f"router {self.name}", filter_subjects=(subjects.USAGE_IDLE_ALL,))
        async for batch in follower.batches():
            for d in batch:
                if d.event.callers and d.event.boot_id != self.boot_id:
                    self.quotas.other_map(d.event)  # (this boot's own use is counted as it happens)
            self._usage_seq = follower.last_seq + 1
            if follower.drained:
                self.usage_caught_up.set()
