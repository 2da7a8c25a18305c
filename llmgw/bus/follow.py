"""One read-decode-skip loop for every component that folds a stream.

A follower reads a stream in order and hands out each batch decoded. A
message that cannot be decoded, or whose payload names another node than its
subject (``subjects.disagrees``), is logged with its stream, sequence and
subject, counted, and skipped: one bad event never stops a component, and
every component says so the same way.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus.frames import RawMsg

if TYPE_CHECKING:
    from llmgw.bus.connection import Bus

log = logging.getLogger(__name__)

T = TypeVar("T")


class Decoded(NamedTuple, Generic[T]):
    """A stored message and the event it holds."""

    raw: RawMsg
    event: T


class Follower(Generic[T]):
    """Read ``stream`` from ``start`` (up to ``stop_at``, or following) and decode with ``decoder``.

    ``keep`` chooses which messages to decode at all (the rest are passed over
    silently, e.g. by subject); ``skipped`` counts those that could not be
    decoded or were refused; ``last_seq`` is the last sequence read, decoded or not.
    """

    def __init__(self, bus: Bus, stream: str, decoder: msgspec.json.Decoder[T], start: int = 1, *,
                 stop_at: int | None = None, idle_expires_s: float = 1.0, who: str = "",
                 keep: Callable[[RawMsg], bool] | None = None,
                 on_skip: Callable[[RawMsg, Exception], None] | None = None) -> None:
        self.bus, self.stream, self.decoder = bus, stream, decoder
        self.start, self.stop_at, self.idle_expires_s = start, stop_at, idle_expires_s
        self.who = who or "reader"
        self.keep, self.on_skip = keep, on_skip
        self.skipped = 0
        self.last_seq = start - 1

    def _skip(self, raw: RawMsg, error: Exception, what: str) -> None:
        self.skipped += 1
        log.warning("%s: %s seq %d (%s) %s, skipped: %s", self.who, self.stream, raw.seq, raw.subject, what, error)
        if self.on_skip is not None:
            self.on_skip(raw, error)

    async def batches(self) -> AsyncIterator[list[Decoded[T]]]:
        reader = self.bus.reader(self.stream, self.start, stop_at=self.stop_at, idle_expires_s=self.idle_expires_s,
                                 purpose=self.who)
        decode = self.decoder.decode
        async for batch in reader.batches():
            out: list[Decoded[T]] = []
            for raw in batch:
                if self.keep is not None and not self.keep(raw):
                    continue
                try:
                    event = decode(raw.data)
                except m.DECODE_ERRORS as e:
                    self._skip(raw, e, "cannot be decoded")
                    continue
                why = subjects.disagrees(raw.subject, event)  # type: ignore[arg-type]
                if why is not None:
                    self._skip(raw, ValueError(why), "refused")
                    continue
                out.append(Decoded(raw, event))
            self.last_seq = batch[-1].seq
            yield out


