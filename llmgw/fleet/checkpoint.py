"""A fold and where its reader stood, as bytes: the projector's checkpoint row and the bus's snapshots.

Besides the fleet state, a checkpoint carries what the long-running services
keep beyond it, folded from the same events at the same positions: the models'
history (status), the scheduler's demand memory, the planner's observed KV
reservations, the routers' pool and the liveness monitor's lost nodes. A service
then starts from the newest snapshot and reads only what came after it
(``fold_event`` is the one rule every reader folds by).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

import msgspec

from llmgw import messages as m
from llmgw.fleet import demand, observed
from llmgw.fleet.fold import FOLD_VERSION, Cursor, FleetState, apply, refusal
from llmgw.fleet.history import ModelHistory
from llmgw.fleet.pool import Pool


@dataclass
class Checkpoint:
    """The folded state, where its reader stood in each stream, and what the services keep beyond it.

    ``fold_version`` is stamped when it is encoded: a decoded one of an older version
    (0: written before it was stamped) lacks the history and the services' memory, and
    whoever resumes from it folds them again up to its cursor (``llmgw.fleet.replay``).
    """

    state: FleetState = field(default_factory=FleetState)
    cursor: Cursor = field(default_factory=Cursor)
    history: ModelHistory = field(default_factory=ModelHistory)
    demand: demand.SchedulerMemory = field(default_factory=demand.SchedulerMemory)
    observed: dict[str, int] = field(default_factory=dict)  # KV tokens by planner.observation_key
    pool: Pool = field(default_factory=Pool)  # the routers' (pooled_at 0: a router stamps its own start)
    # The liveness monitor's: each node lost and not returned, and where its NodeLost is stored in the
    # fleet stream (NodeReturned's msg id answers it). A node's inventory does not clear it here.
    lost_at_seq: dict[str, int] = field(default_factory=dict)
    fold_version: int = field(default=0, compare=False)  # metadata: not part of what two folds agree on

    def complete(self) -> bool:
        """Whether it carries everything this version folds (a fresh one, or one decoded from this version)."""
        return self.fold_version == FOLD_VERSION or not any(self.cursor.positions.values())


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Checkpoint)


def encode_state(state: FleetState, cursor: Cursor, history: ModelHistory | None = None) -> bytes:
    """A state, its cursor and the models' history as bytes (msgpack), without the services' memory:
    not stamped with the fold version, so whoever resumes from it folds that memory again."""
    return _ENCODER.encode(Checkpoint(state, cursor, history if history is not None else ModelHistory()))


def encode(checkpoint: Checkpoint) -> bytes:
    checkpoint.fold_version = FOLD_VERSION  # this code folded it: all of it is there
    return _ENCODER.encode(checkpoint)


def fold_event(c: Checkpoint, seq: int, subject: str, event: m.Event) -> bool:
    """Fold one decoded event (times clamped) as every reader does; False when it is refused.

    The services' memory sees it first, on the state before it (``scheduler.observe``'s rule).
    """
    if refusal(c.state, subject, event) is not None:
        return False
    observe(c, seq, subject, event)
    apply(c.state, event, seq)
    return True


def observe(c: Checkpoint, seq: int, subject: str, event: m.Event) -> None:
    """The services' memory of an event not refused, before ``apply`` folds it into the state."""
    kind = type(event)
    if kind is _IDLE_MAP:  # most of the usage stream, so the most frequent: straight to its case
        demand.observe_idle_map(c.demand, event, subject)  # type: ignore[arg-type]
    elif kind is m.NodeLost:
        c.lost_at_seq[event.node] = seq  # type: ignore[attr-defined]
    elif kind is m.NodeReturned or kind is m.NodeRetired:
        c.lost_at_seq.pop(event.node, None)  # type: ignore[attr-defined]
    elif kind is not _HEALTH:  # the most frequent fleet event: no memory reads it
        demand.observe(c.demand, event, c.state, seq, subject)
        if kind is m.ReplicaStateChanged:
            observed.record_observation(c.observed, c.state, event)  # type: ignore[arg-type]
        if kind in _CONTROL:
            c.pool.apply(event, 0.0, seq)  # type: ignore[arg-type]


_IDLE_MAP, _HEALTH = m.IdleMapPublished, m.GpuHealthChanged
_CONTROL = frozenset(typing.get_args(m.ControlEvent))


def decode_state(data: bytes) -> Checkpoint:
    return _DECODER.decode(data)
