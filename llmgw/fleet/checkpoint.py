"""A fold and where its reader stood, as bytes: the projector's checkpoint row and the bus's snapshots."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from llmgw.fleet.fold import Cursor, FleetState


@dataclass
class Checkpoint:
    """The folded state, and where its reader stood in each stream."""

    state: FleetState = field(default_factory=FleetState)
    cursor: Cursor = field(default_factory=Cursor)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Checkpoint)


def encode_state(state: FleetState, cursor: Cursor) -> bytes:
    """A state and its cursor as bytes (msgpack)."""
    return _ENCODER.encode(Checkpoint(state, cursor))


def decode_state(data: bytes) -> Checkpoint:
    return _DECODER.decode(data)
