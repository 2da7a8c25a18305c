"""A fold and where its reader stood, as bytes: the projector's checkpoint row and the bus's snapshots."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from llmgw import subjects
from llmgw.fleet.fold import Cursor, FleetState
from llmgw.fleet.history import ModelHistory


@dataclass
class Checkpoint:
    """The folded state, where its reader stood in each stream, and the models' history up to there.

    A checkpoint written before ``history`` travelled in it decodes with an empty one
    (position 0): whoever loads it reads the control stream up to the cursor once.
    """

    state: FleetState = field(default_factory=FleetState)
    cursor: Cursor = field(default_factory=Cursor)
    history: ModelHistory = field(default_factory=ModelHistory)

    def history_behind(self) -> int:
        """The control-stream sequence the history must be read up to, or 0 when it is complete."""
        folded = self.cursor.positions.get(subjects.STREAM_CONTROL, 0)
        return folded if self.history.position < folded else 0


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Checkpoint)


def encode_state(state: FleetState, cursor: Cursor, history: ModelHistory | None = None) -> bytes:
    """A state, its cursor and the models' history as bytes (msgpack)."""
    return _ENCODER.encode(Checkpoint(state, cursor, history if history is not None else ModelHistory()))


def decode_state(data: bytes) -> Checkpoint:
    return _DECODER.decode(data)
