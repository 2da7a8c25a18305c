"""A fold and where its reader stood, as bytes: the projector's checkpoint row and the bus's snapshots.

Besides the fleet state, a checkpoint carries what the long-running services
keep beyond it, folded from the same events at the same positions: the models'
history (status), the scheduler's demand memory, the planner's observed KV
reservations, the routers' pool and the liveness monitor's lost nodes. A service
then starts from the newest snapshot and reads only what came after it
(``fold_batch`` is the one rule every reader folds by: the projector, a
replay, the scheduler, the planner, the routers' pool and the liveness monitor).
"""

from __future__ import annotations

import logging
import typing
from dataclasses import dataclass, field

import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.fleet import demand, observed
from llmgw.fleet.history import ModelHistory
from llmgw.fleet.pool import Pool
from llmgw.fleet.state import (
    FOLD_VERSION,
    Cursor,
    FleetState,
    apply,
    clamp_times,
    refusal,
    requests_moved,
)


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
    # KV reservations this reader refused (implausible, or not from the replica's node): its counter,
    # not part of the fold (not a field, never in a snapshot).
    refused_observations = 0

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


class Stored(typing.Protocol):
    """Where a stream holds a message: what a fold needs of it besides the decoded event."""

    @property
    def seq(self) -> int: ...
    @property
    def subject(self) -> str: ...
    @property
    def ts_ns(self) -> int: ...


@dataclass(frozen=True)
class Memories:
    """Which of the services' memories a reader keeps. Whatever it keeps, it refuses, clamps
    and applies exactly as every other reader: only what it remembers differs."""

    history: bool = True  # the models' latest events and GPU-hours (status)
    demand: bool = True  # the scheduler's
    observed: bool = True  # the planner's KV reservations
    pool: bool = True  # the routers'
    lost: bool = True  # the liveness monitor's


EVERY = Memories()
# A writer's hook, called with each event about to be folded (and an idle map's ``requests_moved``).
Before = typing.Callable[[int, m.Event, list[str] | None], None]


def fold_batch(c: Checkpoint, stream: str, stored: typing.Sequence[Stored], events: list[typing.Any], *,
               keep: Memories = EVERY, now: float = 0.0, before: Before | None = None,
               subjects_checked: bool = False) -> list[str | None]:
    """Fold a batch of one stream's decoded events, in stream order, by the one rule every reader folds by.

    For each event: a subject its payload disagrees with is refused; its time is clamped to
    when the stream stored it (``clamp_times``, in place in ``events``); a state report from a
    node its replica is not on is refused; then a control event is noted in the models'
    history, the memories kept see it on the state before it, ``before(i, event)`` is called
    (a writer's hook, with an idle map's ``requests_moved``: the map's one diff), and ``apply`` folds it. The cursor moves past each. Returns, per event,
    why it was refused, or None when it was folded. ``now`` is the wall clock a router's pool
    stamps on a replica it takes in (0: a reader's fold, the same in every process).
    ``subjects_checked``: the reader's follower refused every event its subject disagrees with
    already (``bus.Follower``), so none is checked twice.
    """
    n = len(events)
    why: list[str | None] = [None] * n if subjects_checked else \
        [subjects.disagrees(x.subject, e) for x, e in zip(stored, events, strict=True)]
    fresh = [i for i in range(n) if why[i] is None]
    cursor = c.cursor
    if len(fresh) == n:
        cursor.clamped += clamp_times(events, [x.ts_ns for x in stored])
    elif fresh:
        some = [events[i] for i in fresh]
        cursor.clamped += clamp_times(some, [stored[i].ts_ns for i in fresh])
        for i, event in zip(fresh, some, strict=True):
            events[i] = event
    note = c.history.note if keep.history and stream == subjects.STREAM_CONTROL else None
    # The routers' part of the cold-start ledger comes on the usage stream.
    answered = c.history.note_answered if keep.history and stream == subjects.STREAM_USAGE else None
    state, positions, stored_ns = c.state, cursor.positions, cursor.stored_ns
    for i in range(n):
        x, event = stored[i], events[i]
        if why[i] is None:
            why[i] = refusal(state, x.subject, event, subject_checked=True)
        if why[i] is None:
            if note is not None:  # a refused report is no part of a model's history (`ctl model show`)
                note(x.seq, event)
            elif answered is not None and type(event) is _ANSWERED:
                answered(event)
            _observe(c, keep, x.seq, x.subject, event, now)
            moved = requests_moved(event, state.routers.get(event.router)) if type(event) is _IDLE_MAP else None
            if before is not None:
                before(i, event, moved)
            apply(state, event, x.seq, moved)
        else:
            cursor.unprojected += 1
        if x.seq > positions.get(stream, 0):
            positions[stream], stored_ns[stream] = x.seq, x.ts_ns
    return why


def _observe(c: Checkpoint, keep: Memories, seq: int, subject: str, event: m.Event, now: float) -> None:
    """The memories kept, of an event not refused, before ``apply`` folds it into the state."""
    kind = type(event)
    if kind is _IDLE_MAP:  # most of the usage stream, so the most frequent: straight to its case
        if keep.demand:
            demand.observe_idle_map(c.demand, event, subject)  # type: ignore[arg-type]
    elif kind is m.NodeLost:
        if keep.lost:
            c.lost_at_seq[event.node] = seq  # type: ignore[attr-defined]
    elif kind is m.NodeReturned or kind is m.NodeRetired:
        if keep.lost:
            c.lost_at_seq.pop(event.node, None)  # type: ignore[attr-defined]
    elif kind is not _HEALTH:  # the most frequent fleet event: no memory reads it
        if keep.demand:
            demand.observe(c.demand, event, c.state, seq, subject)
        if kind is m.ReplicaStateChanged and keep.observed and \
                observed.record_observation(c.observed, c.state, event) is False:  # type: ignore[arg-type]
            c.refused_observations += 1
            log.warning("seq %d: KV reservation %d from %s for %s refused (implausible, or not its replica's "
                        "node)", seq, event.observed_kv_tokens, event.node, event.replica_id)  # type: ignore[attr-defined]
        if kind in _CONTROL and keep.pool:
            c.pool.apply(event, now, seq)  # type: ignore[arg-type]


log = logging.getLogger(__name__)
_IDLE_MAP, _HEALTH, _ANSWERED = m.IdleMapPublished, m.GpuHealthChanged, m.WakeAnswered
_CONTROL = frozenset(typing.get_args(m.ControlEvent))


def decode_state(data: bytes) -> Checkpoint:
    return _DECODER.decode(data)
