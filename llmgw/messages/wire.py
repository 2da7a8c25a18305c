"""Codecs, built once: one decoder per stream, any event, the encoder."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import msgspec

from llmgw.messages.base import ErrorReply
from llmgw.messages.control import ControlEvent, EngineKeyEvent
from llmgw.messages.fleet import FleetEvent, HeartbeatEvent
from llmgw.messages.usage import MapCallers, UsageEvent

AnyEvent = FleetEvent | HeartbeatEvent | UsageEvent | ControlEvent


# --- codecs, built once -------------------------------------------------------

ENCODER = msgspec.json.Encoder()
FLEET_DECODER = msgspec.json.Decoder(FleetEvent)
HEARTBEAT_DECODER = msgspec.json.Decoder(HeartbeatEvent)
USAGE_DECODER = msgspec.json.Decoder(UsageEvent)
MAP_CALLERS_DECODER = msgspec.json.Decoder(MapCallers)  # idle maps, as a router's quotas read them
CONTROL_DECODER = msgspec.json.Decoder(ControlEvent)
# Not in AnyEvent: an engine key is read only where it is used (the router), never by a reader of every stream.
ENGINE_KEY_DECODER = msgspec.json.Decoder(EngineKeyEvent)
ANY_DECODER = msgspec.json.Decoder(AnyEvent)
ERROR_DECODER = msgspec.json.Decoder(ErrorReply)


# Everything a decoder raises on bytes it cannot use. Deep nesting (~1,000
# levels, even inside an unknown field) raises RecursionError, not DecodeError;
# a reader that did not catch it would die on the same event at every restart.
DECODE_ERRORS: tuple[type[Exception], ...] = (msgspec.DecodeError, RecursionError)


def encode(message: msgspec.Struct) -> bytes:
    """Bytes for the bus."""
    return ENCODER.encode(message)


def decode_event(data: bytes) -> AnyEvent:
    """An event from bytes of any stream; raises msgspec.DecodeError or ValidationError."""
    return ANY_DECODER.decode(data)


class Stored(Protocol):
    """A message as a stream stores it: what decoding needs of it."""

    @property
    def seq(self) -> int: ...
    @property
    def subject(self) -> str: ...
    @property
    def data(self) -> bytes: ...


S = TypeVar("S", bound=Stored)
T = TypeVar("T")
Skip = Callable[[Any, Exception], None]


def decode_each(stream: str, msgs: Sequence[S], decode: Callable[[bytes], T], skip: Skip, *,
                who: str = "reader", skipped: str = "skipped") -> tuple[list[S], list[T]]:
    """The messages of one batch that decode, and their events, in stream order.

    Each that cannot be decoded is logged (``who``: the reader; ``skipped``: what becomes of it)
    and handed to ``skip``; it never stops the batch.
    """
    stored: list[S] = []
    events: list[T] = []
    for raw in msgs:
        try:
            events.append(decode(raw.data))
        except DECODE_ERRORS as e:
            log.warning("%s: %s seq %d (%s) cannot be decoded, %s: %s", who, stream, raw.seq, raw.subject, skipped, e)
            skip(raw, e)
            continue
        stored.append(raw)
    return stored, events


log = logging.getLogger(__name__)
