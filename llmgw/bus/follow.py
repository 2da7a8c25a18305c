"""One read-decode-skip loop for every component that folds a stream.

A follower reads a stream in order and hands out each batch decoded. A
message that cannot be decoded, or whose payload names another node than its
subject (``subjects.disagrees``), is logged with its stream, sequence and
subject, counted, and skipped: one bad event never stops a component, and
every component says so the same way (``messages.decode_each``: the one
decode-or-skip step, which the projector, a replay and what-if run on the
batches they read themselves).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus.frames import READER_BYTES_IN_FLIGHT, RawMsg

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
    ``filter_subjects`` has the server deliver only those subjects (the rest never leave it), and
    ``max_bytes_in_flight`` bounds what it may have sent this reader and the reader not yet taken.
    With a filter, the stream's last sequence may never be one this follower sees: ``drained`` says
    that nothing it matches was left on the server when the last batch was cut (and a filtered
    follower hands out one empty batch when it finds nothing to read at all), so "caught up" is
    ``last_seq >= what was stored`` or ``drained``.
    """

    def __init__(self, bus: Bus, stream: str, decoder: msgspec.json.Decoder[T], start: int = 1, *,
                 stop_at: int | None = None, idle_expires_s: float = 1.0, who: str = "",
                 keep: Callable[[RawMsg], bool] | None = None,
                 on_skip: Callable[[RawMsg, Exception], None] | None = None,
                 filter_subjects: Sequence[str] = (), max_bytes_in_flight: int = READER_BYTES_IN_FLIGHT) -> None:
        self.bus, self.stream, self.decoder = bus, stream, decoder
        self.filter_subjects, self.max_bytes_in_flight = tuple(filter_subjects), max_bytes_in_flight
        self.start, self.stop_at, self.idle_expires_s = start, stop_at, idle_expires_s
        self.who = who or "reader"
        self.keep, self.on_skip = keep, on_skip
        self.skipped = 0
        self.last_seq = start - 1
        self.drained = False

    def _skip(self, raw: RawMsg, error: Exception) -> None:
        self.skipped += 1
        if self.on_skip is not None:
            self.on_skip(raw, error)

    async def batches(self) -> AsyncIterator[list[Decoded[T]]]:
        """Each batch's messages that decode and agree with their subjects: what a reader may hand to
        ``fold_batch(..., subjects_checked=True)``, which then checks no subject again."""
        reader = self.bus.reader(self.stream, self.start, stop_at=self.stop_at, idle_expires_s=self.idle_expires_s,
                                 filter_subjects=self.filter_subjects, max_bytes_in_flight=self.max_bytes_in_flight,
                                 purpose=self.who, say_drained=bool(self.filter_subjects))
        decode, keep = self.decoder.decode, self.keep
        async for batch in reader.batches():
            wanted = batch if keep is None else [raw for raw in batch if keep(raw)]
            stored, events = m.decode_each(self.stream, wanted, decode, self._skip, who=self.who)
            out: list[Decoded[T]] = []
            for raw, event in zip(stored, events, strict=True):
                why = subjects.disagrees(raw.subject, event)  # type: ignore[arg-type]
                if why is not None:
                    log.warning("%s: %s seq %d (%s) refused, skipped: %s", self.who, self.stream, raw.seq, raw.subject,
                                why)
                    self._skip(raw, ValueError(why))
                    continue
                out.append(Decoded(raw, event))
            if batch:
                self.last_seq = batch[-1].seq
            self.drained = reader.drained
            yield out


