"""Codecs, built once: one decoder per stream, any event, the encoder."""

from __future__ import annotations

import msgspec

from llmgw.messages.base import ErrorReply
from llmgw.messages.control import ControlEvent
from llmgw.messages.fleet import FleetEvent, HeartbeatEvent
from llmgw.messages.usage import UsageEvent

AnyEvent = FleetEvent | HeartbeatEvent | UsageEvent | ControlEvent


# --- codecs, built once -------------------------------------------------------

ENCODER = msgspec.json.Encoder()
FLEET_DECODER = msgspec.json.Decoder(FleetEvent)
HEARTBEAT_DECODER = msgspec.json.Decoder(HeartbeatEvent)
USAGE_DECODER = msgspec.json.Decoder(UsageEvent)
CONTROL_DECODER = msgspec.json.Decoder(ControlEvent)
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
